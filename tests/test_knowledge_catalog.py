"""The knowledge catalog: every entry's files exist and every note cites its sources; a role reads only
the entries for its target's ops and the GPU in use; each runnable kernel in the catalog passes the
real evaluator up to parity, like any code; a family's knob values include the kernel's own."""
from __future__ import annotations

import pytest

import torch

from agent.knowledge import KNOWLEDGE, CatalogError, gpu_arch, load_catalog, read_knobs, with_knobs

CATALOG = load_catalog()
KERNELS = [e for e in CATALOG.entries if "kernel" in e.tags]
HERE = gpu_arch(torch.device("cuda" if torch.cuda.is_available() else "cpu"))


def test_every_note_cites_its_sources_and_every_entry_has_a_summary():
    for entry in CATALOG.entries:
        assert entry.summary
        if "kernel" not in entry.tags:
            assert "Sources:" in entry.text(), entry.id


def test_a_role_reads_only_the_entries_for_its_ops_and_the_gpu_in_use():
    on_h200 = {e.id for e in CATALOG.select("attention", ["decode"], "sm90")}
    on_cpu = {e.id for e in CATALOG.select("attention", ["decode"], "cpu")}
    assert "hopper-sm90" in on_h200 and "hopper-sm90" not in on_cpu
    assert "cpu-interpreter" in on_cpu and "cpu-interpreter" not in on_h200
    assert not any("prefill" in i for i in on_h200 | on_cpu)
    assert {"attention-decode-notes", "decode-paged-splitkv", "verify-and-measure"} <= on_h200 & on_cpu
    assert CATALOG.select("rmsnorm", ["forward"], "sm100") == [e for e in CATALOG.entries
                                                               if e.target == e.op == e.arch == "any"]


@pytest.mark.parametrize("entry", KERNELS, ids=[e.id for e in KERNELS])
def test_each_catalog_kernel_passes_the_evaluator_up_to_parity(entry, evaluate_source):
    if entry.arch not in ("any", HERE):
        pytest.skip(f"{entry.id} runs on {entry.arch} only (tests/test_gluon_*.py compile it for that GPU)")
    verdict = evaluate_source((KNOWLEDGE / entry.files[0]).read_text(), until="parity")
    assert verdict.ok, verdict.reason
    assert [s.name for s in verdict.stages] == ["compile", "dispatch", "parity"]


def test_each_family_varies_the_knobs_its_kernel_file_defines():
    for entry in KERNELS:
        source = (KNOWLEDGE / entry.files[0]).read_text()
        knobs = read_knobs(source)
        for name, spec in entry.family.knobs.items():
            assert knobs[name] in spec.values
            other = next(v for v in spec.values if v != knobs[name])
            assert read_knobs(with_knobs(source, {name: other}, "variant"))[name] == other


def test_a_catalog_naming_a_missing_file_or_a_foreign_default_is_refused(tmp_path):
    text = (KNOWLEDGE / "catalog.yaml").read_text()
    (tmp_path / "attention").mkdir()
    for f in ("attention/decode_paged_splitkv.py",):
        (tmp_path / f).write_text((KNOWLEDGE / f).read_text())
    bad = tmp_path / "catalog.yaml"
    bad.write_text(text)
    with pytest.raises(CatalogError, match="names attention/decode.md, which does not exist"):
        load_catalog(bad)
    (tmp_path / "attention/decode.md").write_text("x")
    lone = text.split("  - id: attention-prefill-notes")[0] + "  - id: decode-paged-splitkv" + \
        text.split("  - id: decode-paged-splitkv")[1].split("  - id: prefill-causal-tiled")[0]
    bad.write_text(lone.replace("values: [16, 32, 64, 128]", "values: [16, 32]", 1))
    with pytest.raises(CatalogError, match=r"knob BLOCK_N = 64 .* is not among its values \[16, 32\]"):
        load_catalog(bad)


def test_the_heads_are_the_reference_kernels_unless_config_names_another_family_of_the_op():
    assert [e.id for e, _ in CATALOG.families("attention", "decode")] == ["decode-paged-splitkv", "decode-paged-gqa",
                                                                          "decode-paged-lean", "decode-gluon-sm90"]
    assert CATALOG.family("attention", "decode")[0].id == "decode-paged-splitkv"
    moved = CATALOG.heads_first("attention", {"decode": "decode-paged-gqa"}, "cpu")
    assert moved.family("attention", "decode")[0].id == "decode-paged-gqa"
    assert moved.family("attention", "prefill")[0].id == "prefill-causal-tiled"       # an op not named keeps its reference
    assert sorted(e.id for e in moved.entries) == sorted(e.id for e in CATALOG.entries)
    with pytest.raises(CatalogError, match=r"^agent.heads.decode: 'prefill-causal-tma' is not a kernel family of "
                                           r"attention.decode in knowledge/catalog.yaml \(known: decode-paged-splitkv, "
                                           r"decode-paged-gqa, decode-paged-lean, decode-gluon-sm90\)$"):
        CATALOG.heads_first("attention", {"decode": "prefill-causal-tma"}, "sm90")
    with pytest.raises(CatalogError, match=r"^agent.heads.prefill: prefill-gluon-sm90 runs on sm90 only, not on this "
                                           r"device \(cpu\)$"):
        CATALOG.heads_first("attention", {"prefill": "prefill-gluon-sm90"}, "cpu")
    on_sm90 = CATALOG.heads_first("attention", {"prefill": "prefill-gluon-sm90"}, "sm90")
    assert on_sm90.family("attention", "prefill")[0].id == "prefill-gluon-sm90"
