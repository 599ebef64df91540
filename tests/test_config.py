"""config.yaml is validated at load: every default present, and each mistake is one line naming the key."""
from __future__ import annotations

import pytest

from conftest import ROOT
from harness.config import ConfigError, load_config


def write(tmp_path, text: str):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def edited(old: str, new: str) -> str:
    text = (ROOT / "config.yaml").read_text()
    assert old in text
    return text.replace(old, new, 1)


def test_project_config_loads():
    cfg = load_config()
    assert cfg.targets.attention.cuda.dtype == "bfloat16" and cfg.targets.attention.cpu.dtype == "float32"


@pytest.mark.parametrize("old, new, words", [
    ("  sandbox: required", "  sandbox: required\n  sandboxx: 1", "worker.sandboxx: unknown key"),
    ("checks_per_shape: 2", "checks_per_shape: 0", "stages.parity.checks_per_shape: Input should be greater than or equal to 1"),
    ("device: auto", "device: tpu", "device: Input should be 'auto', 'cuda' or 'cpu'"),
    ("heads: [[4, 2], [4, 1]]", "heads: [[4, 3]]", "targets.attention.cpu: heads [4, 3]"),
    ("lengths: [5, 24], weight: 0.7", "lengths: [24, 5], weight: 0.7", "lengths: lengths must be [lo, hi]"),
    ("env_passthrough: [PATH,", "env_passthrough: [OPENAI_API_KEY, PATH,", "OPENAI_API_KEY looks like a secret"),
    ("    reps: 30", "", "stages.microbench.reps: missing key"),
    ("  heads: {}", "  heads: {attention: decode-paged-gqa}", "agent: heads names op 'attention', which is not in agent.ops"),
    ("proposals_in_flight: null", "proposals_in_flight: 0", "agent.proposals_in_flight: Input should be greater than or equal to 1"),
    ("verdict_cache: true", "verdict_cache: sometimes", "executor.verdict_cache: Input should be a valid boolean"),
    ("warm_threads: {cuda: 8, cpu: 0}", "warm_threads: {cuda: 8, gpu: 0}", "stages.parity.warm_threads.gpu: unknown key"),
])
def test_a_mistake_is_one_line_naming_the_key(tmp_path, old, new, words):
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, edited(old, new)))
    assert words in str(err.value) and "\n" not in str(err.value)


def test_missing_and_malformed_files_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "device: [auto\n"))


def test_several_mistakes_are_all_named_each_with_its_key(tmp_path):
    text = "\n".join(line for line in edited("checks_per_shape: 2", "checks_per_shape: 0").splitlines()
                     if not line.startswith("    reps: 30"))
    text = text.replace("  sandbox: required", "  sandbox: required\n  sandboxx: 1", 1)
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, text))
    message = str(err.value)
    assert "\n" not in message and "3 errors" in message and "more)" not in message
    for words in ("worker.sandboxx: unknown key", "stages.parity.checks_per_shape: Input should be greater than",
                  "stages.microbench.reps: missing key"):
        assert words in message, message


def test_a_folder_or_an_undecodable_file_given_as_config_says_so(tmp_path):
    with pytest.raises(ConfigError, match="is a folder, not a config file"):
        load_config(tmp_path)
    binary = tmp_path / "binary.yaml"
    binary.write_bytes(b"device: \xff\xfe\n")
    with pytest.raises(ConfigError, match="binary.yaml: not UTF-8 text"):
        load_config(binary)


@pytest.mark.parametrize("name", ["OPENAI_API_KEY", "HF_TOKEN", "DB_PASSWD", "CLOUD_CREDENTIALS", "GH_AUTH"])
def test_config_refuses_to_pass_on_every_name_the_sandbox_keeps_from_a_candidate(tmp_path, monkeypatch, name):
    from harness.sandbox import clean_env
    monkeypatch.setenv(name, "value-of-a-secret")
    assert name not in clean_env([name], {})                   # the worker's environment never has it
    with pytest.raises(ConfigError, match=f"{name} looks like a secret"):
        load_config(write(tmp_path, edited("env_passthrough: [PATH,", f"env_passthrough: [{name}, PATH,")))
