"""Attacks on the dispatch stage and the checks beside it: a candidate that uses the library only when no check
is watching (tests/adversarial/), a candidate that hogs the GPU's memory, and the NaN-timing attack. Each
asserts the verdict it gets now. The GPU ones are marked `cuda` (run on the H200; docs/BENCHMARKS.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

import candidates as C
from conftest import CUDA, RUNTIME_ONLY, config_with, runtime_only
from harness.stages.common import Rejected
from harness.stages.replay import run_gates, run_replay

ADVERSARIAL = Path(__file__).resolve().parent / "adversarial"


def attack(name: str) -> str:
    return C.wrap_decode((ADVERSARIAL / f"{name}_body.py").read_text())


def test_the_stage_aware_sdpa_candidate_is_refused_by_the_allowlist_naming_line_and_name(evaluate_source):
    source = attack("stage_aware_sdpa")
    line = source.splitlines().index("import torch.nn.functional as F") + 1
    v = evaluate_source(source)
    assert v.failed_stage == "compile", v.reason
    assert v.stages[-1].reason.startswith(f"line {line}: torch.nn.functional: imports a module outside the allowlist")


def test_the_stage_aware_candidate_written_to_pass_the_allowlist_is_caught_at_parity_by_the_audit_on_every_call(
        evaluate_source):
    """Its kernel on compile's, the audit's and the ablation's calls; torch elementwise attention after. Before
    the audit watched every call, this passed dispatch and parity."""
    v = evaluate_source(attack("stage_aware_elementwise"))
    assert v.failed_stage == "parity", v.reason
    reason = v.stages[-1].reason
    assert reason.startswith("decode (parity, decode ") and "torch ops outside the kernel touch" in reason, reason


def test_sdpa_on_any_call_past_the_allowlist_is_a_rejection_at_the_first_call_that_makes_it(evaluate_source):
    v = evaluate_source(attack("stage_aware_sdpa_later"), config=runtime_only())
    assert v.failed_stage == "parity", v.reason
    assert "library compute instead of the candidate's kernel: aten::_scaled_dot_product" in v.stages[-1].reason
    assert v.stages[-1].failure == "library_ops"


def test_torch_attention_inside_a_launchs_grid_callable_counts_as_torch_work_outside_the_kernel(evaluate_source):
    """Triton calls a callable grid from within its launch; the audit once took all of a launch for Triton's own
    plumbing and counted nothing there, so this passed compile, dispatch, parity and the replay's gates."""
    v = evaluate_source(attack("grid_callable"), until="parity")
    assert v.failed_stage == "compile", v.reason
    assert "torch ops outside the kernel touch" in v.stages[-1].reason, v.stages[-1].reason


KEYED_ON_THE_CACHE = C.wrap_decode("""
_keys = []

def decode(@ARGS@):
    _keys.append(k_cache.amax(dim=0))      # a torch reduction over the whole cache: a key for an output cache
    return @REF@(@ARGS@)
""")


def test_a_torch_reduction_over_the_whole_cache_counts_what_it_reads(evaluate_source):
    """A reduction makes few elements from many: counted by its output, a key read from the whole cache in torch (what
    an output cache keyed on its inputs needs) cost the audit nothing. Counted by what it reads, it is the cache's
    size each call, over `aux_work_fraction` of decode's multiply-adds."""
    v = evaluate_source(KEYED_ON_THE_CACHE, until="dispatch")
    assert v.failed_stage in ("compile", "dispatch"), v.reason
    assert "torch ops outside the kernel touch" in v.stages[-1].reason and "aten::amax" in v.stages[-1].reason, v.reason


def test_a_name_the_file_never_binds_is_refused_before_it_runs(evaluate_source):
    source = attack("interpreter_globals").replace("@BIND@", "")
    v = evaluate_source(source, until="compile")
    line = next(i for i, text in enumerate(source.splitlines(), 1) if "inspect.getmembers" in text)
    assert v.failed_stage == "compile", v.reason
    assert v.stages[-1].reason.startswith(f"line {line}: inspect: a name the file never binds"), v.stages[-1].reason


def test_the_interpreter_leaves_no_module_of_its_own_in_a_kernels_module(evaluate_source):
    """A name bound only on a branch that never runs passes the reader; at run time it is unbound, as Python has
    it, and not the interpreter's `inspect` (on a GPU, nothing is copied in to begin with)."""
    v = evaluate_source(attack("interpreter_globals").replace("@BIND@", "if len(__name__) < 0:\n    inspect = None"),
                        until="compile")
    assert v.failed_stage == "compile", v.reason
    assert "NameError" in v.stages[-1].reason and "'inspect' is not defined" in v.stages[-1].reason, v.stages[-1].reason


@pytest.mark.parametrize("decoy, words, judged_by", [
    ("False", "of its calls launched no Triton kernel", run_gates),
    ("True", "torch ops outside the kernel touch", run_gates),
    ("True", "torch ops outside the kernel touch", run_replay),
], ids=["torch-alone-cpu-gates", "torch-beside-a-decoy-launch-cpu-gates", "torch-beside-a-decoy-launch-paired"])
def test_a_kernel_that_runs_torch_attention_only_where_it_is_served_is_rejected_by_its_served_calls(
        decoy, words, judged_by):
    """It tells the served process from parity by the cache it is handed, and passed compile, dispatch, parity and
    the replay's gates (the tokens are right: it is torch attention). Its served calls are now watched as its calls
    in the worker are, and held to the same rules: by the CPU's gates-only replay and by the paired one."""
    with pytest.raises(Rejected) as e:
        judged_by(config_with(), "cpu", served_only(decoy))
    assert str(e.value).startswith("decode in the candidate's served process") and words in str(e.value), str(e.value)


def served_only(decoy: str, offset_only: str = "False") -> str:
    body = (ADVERSARIAL / "served_only_torch_body.py").read_text()
    return C.wrap_decode(body.replace("@DECOY@", decoy).replace("@OFFSET_ONLY@", offset_only))


@pytest.mark.parametrize("offset_only", ["False", "True"], ids=["by-pool-or-offset", "by-offset-alone"])
def test_parity_hands_decode_the_cache_as_served_so_a_kernel_that_tells_them_apart_is_caught_there(
        evaluate_source, offset_only):
    """With every decode check handed the cache as served (stages.parity.served_layout 1; by default half of them),
    the kernel that serves torch attention only where it is served does so in parity, and is rejected there. By the
    offset alone: the worker hands a view at the offset the trusted side drew (layer 1 of 2), not a copy at 0."""
    v = evaluate_source(served_only("False", offset_only), until="parity",
                        config=config_with(**{"stages.parity.served_layout": 1.0}))
    reason = v.stages[-1].reason
    assert v.failed_stage == "parity" and "the cache as served" in reason, v.reason
    assert offset_only == "False" or "layer 1's view" in reason, reason
    assert "torch ops outside the kernel touch" in reason or "no Triton kernel was launched" in reason, reason


def test_a_kernel_wrong_only_at_batches_no_fixed_shape_had_is_caught_at_a_drawn_batch(evaluate_source):
    """Every served-shape check at a drawn batch here (stages.parity.batch_drawn 1, six checks a shape; by default
    half of them, two a shape): 12 draws from 1..17 miss the band 6-15 with odds of 2e-5."""
    cfg = config_with(**{"stages.parity.batch_drawn": 1.0, "stages.parity.checks_per_shape": 6})
    v = evaluate_source(attack("batch_band"), until="parity", config=cfg)
    assert v.failed_stage == "parity" and " drawn, " in v.stages[-1].reason, v.reason


def test_a_call_answered_from_a_cache_launching_nothing_is_rejected_though_the_request_launched_enough(
        evaluate_source):
    v = evaluate_source(attack("repeat_from_cache"), until="parity")
    assert v.failed_stage in ("dispatch", "parity") and "no Triton kernel was launched" in v.stages[-1].reason, v.reason


# -- on the GPU ---------------------------------------------------------------------------------------------

NAN_TIMER = C.wrap_decode("""
_elapsed = torch.cuda.Event.elapsed_time

def _lie(self, other):
    return VALUE

torch.cuda.Event.elapsed_time = _lie

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")

MEMORY_HOG = C.wrap_decode("""
_held = []
_total = torch.cuda.get_device_properties(0).total_memory
while True:                                # every byte its allocator will give it, kept for good
    try:
        _held.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))
    except Exception:
        break

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    while True:                            # and on each call whatever is left
        try:
            _held.append(torch.empty(1 << 28, dtype=torch.uint8, device=q.device))
        except Exception:
            break
    return _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)
""")


@pytest.mark.parametrize("value, words", [
    ('float("nan")', "reply is not strict JSON: NaN"),
    ("0.0", "Input should be greater than 0"),
    ("-1.0", "Input should be greater than 0"),
    ("1e-7", "under the physical floor"),
], ids=["nan", "zero", "negative", "tiny"])
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_a_patched_event_timer_reporting_nan_zero_negative_or_tiny_times_is_rejected_at_microbench(
        evaluate_source, value, words):
    v = evaluate_source(NAN_TIMER.replace("VALUE", value), until="microbench", config=runtime_only())
    assert v.failed_stage == "microbench", v.reason
    assert words in v.stages[-1].reason, v.stages[-1].reason


def test_the_patched_timer_is_refused_by_the_allowlist_before_it_runs(evaluate_source):
    v = evaluate_source(NAN_TIMER.replace("VALUE", 'float("nan")'))
    assert v.failed_stage == "compile" and "torch.cuda.Event.elapsed_time" in v.stages[-1].reason, v.reason


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_the_stage_aware_candidates_are_rejected_before_microbench_on_the_gpu(evaluate_source):
    assert evaluate_source(attack("stage_aware_sdpa"), until="microbench").failed_stage == "compile"
    for name, config in (("stage_aware_elementwise", None), ("stage_aware_sdpa_later", config_with(**RUNTIME_ONLY))):
        v = evaluate_source(attack(name), until="microbench", config=config)
        assert v.failed_stage in ("compile", "dispatch", "parity"), (name, v.reason)
        print(name, v.reason[:300])


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_a_candidate_that_takes_all_the_gpu_memory_fails_only_itself(evaluate_source):
    """Its worker's allocator stops at worker.gpu_memory_fraction; the evaluator's own work runs in memory it
    took first. The hog's verdict is a verdict (whatever it is), and the next candidate is judged as ever."""
    v = evaluate_source(MEMORY_HOG, until="microbench")
    print(v.reason[:500])
    assert v.stages, v.reason
    nxt = evaluate_source(C.REF_DECODE, until="microbench")
    assert nxt.ok, nxt.reason


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs an NVIDIA GPU (CUDA)")
def test_a_candidate_that_takes_all_its_servers_memory_fails_its_own_server_and_not_the_heads():
    """Each embedded server caps its allocator at served.gpu_memory_fraction before the candidate's code runs
    (harness/gpu_memory.py), so the hog, imported in its server, takes its own share and no more: its own server
    runs out of memory (its rejection, saying so), not the reference's or the head's started beside it (that
    would be a harness error, and with no cap whichever server asked last would have failed)."""
    with pytest.raises(Rejected) as e:
        run_replay(config_with(**{"served.cuda.window_s": 10}), "cuda", MEMORY_HOG)
    print(str(e.value)[:400])
    assert e.value.failure == "server_failed" and "out of memory" in str(e.value).lower(), str(e.value)[:400]
