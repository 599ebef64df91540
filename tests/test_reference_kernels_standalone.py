"""Standalone correctness tests for the two reference attention kernels in
knowledge/attention/. Each kernel file is imported by path (it is a
self-contained candidate), knob variants are produced by rewriting the
`^NAME = value` lines into a temp copy, and every result is compared with a
float64 torch reference (explicit masked softmax, decode gathers through the
block table). On a machine without CUDA the kernels run in the Triton
interpreter in float32."""
import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import importlib.util
import pathlib
import re
import uuid

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DECODE_PATH = ROOT / "knowledge" / "attention" / "decode_paged_splitkv.py"
PREFILL_PATH = ROOT / "knowledge" / "attention" / "prefill_causal_tiled.py"

# The Triton interpreter trips a NumPy scalar-conversion deprecation on every
# program; it is not ours.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.float32
TOL = 1e-4

_MODULE_CACHE = {}


def _load(path, knobs=None, tmp_dir=None):
    """Import a candidate file by path, optionally with knob lines rewritten."""
    knobs = dict(knobs or {})
    key = (str(path), tuple(sorted(knobs.items())))
    if key in _MODULE_CACHE:
        return _MODULE_CACHE[key]
    if knobs:
        text = path.read_text()
        for name, value in knobs.items():
            pattern = re.compile(rf"^{name} = [^\n#]*?(\s*#.*)?$", re.MULTILINE)
            text, n = pattern.subn(lambda m: f"{name} = {value!r}{m.group(1) or ''}", text)
            assert n == 1, f"knob {name} not found exactly once in {path.name}"
        target = pathlib.Path(tmp_dir) / f"{path.stem}_{uuid.uuid4().hex[:8]}.py"
        target.write_text(text)
    else:
        target = path
    spec = importlib.util.spec_from_file_location(f"kevo_ref_{uuid.uuid4().hex[:8]}", target)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    _MODULE_CACHE[key] = module
    return module


@pytest.fixture(scope="module")
def knob_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("knob_variants")


# ----------------------------------------------------------------- references

def decode_reference(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    batch, hq, d = q.shape
    page = k_cache.shape[1]
    hkv = k_cache.shape[2]
    group = hq // hkv
    out = torch.empty(batch, hq, d, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        t = torch.arange(n)
        phys = block_table[b].long().cpu()[t // page]
        k = k_cache.double().cpu()[phys, t % page]  # [n, hkv, d]
        v = v_cache.double().cpu()[phys, t % page]
        for h in range(hq):
            s = (k[:, h // group] @ q[b, h].double().cpu()) * sm_scale
            p = torch.softmax(s, dim=0)
            out[b, h] = p @ v[:, h // group]
    return out


def prefill_reference(q, k, v, cu_seqlens, sm_scale):
    total, hq, d = q.shape
    group = hq // k.shape[1]
    out = torch.empty(total, hq, d, dtype=torch.float64)
    cu = cu_seqlens.cpu().tolist()
    qd, kd, vd = q.double().cpu(), k.double().cpu(), v.double().cpu()
    for b in range(len(cu) - 1):
        s0, s1 = cu[b], cu[b + 1]
        n = s1 - s0
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        for h in range(hq):
            s = (qd[s0:s1, h] @ kd[s0:s1, h // group].T) * sm_scale
            s = s.masked_fill(~causal, float("-inf"))
            out[s0:s1, h] = torch.softmax(s, dim=-1) @ vd[s0:s1, h // group]
    return out


# ------------------------------------------------------------------ inputs

def make_decode_inputs(seq_lens, hq, hkv, d, page, *, extra_pages=1, extra_blocks=3,
                       q_scale=1.0, seed=0):
    """Paged cache with shuffled, non-contiguous block ids; NaN everywhere unused."""
    g = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    max_pages = max(-(-n // page) for n in seq_lens) + extra_pages
    num_blocks = batch * max_pages + extra_blocks
    perm = torch.randperm(num_blocks, generator=g)
    block_table = perm[: batch * max_pages].view(batch, max_pages).to(torch.int32).clone()
    k_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=DTYPE)
    v_cache = torch.full((num_blocks, page, hkv, d), float("nan"), dtype=DTYPE)
    for b, n in enumerate(seq_lens):
        for t in range(n):
            blk = int(block_table[b, t // page])
            k_cache[blk, t % page] = torch.randn(hkv, d, generator=g)
            v_cache[blk, t % page] = torch.randn(hkv, d, generator=g)
        # Unused table entries point at arbitrary (possibly garbage / shared) blocks.
        used = -(-n // page)
        block_table[b, used:] = torch.randint(0, num_blocks, (max_pages - used,), generator=g,
                                              dtype=torch.int32)
    q = torch.randn(batch, hq, d, generator=g, dtype=DTYPE) * q_scale
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)
    return [x.to(DEVICE) for x in (q, k_cache, v_cache, block_table, seq_lens_t)]


def make_prefill_inputs(lens, hq, hkv, d, *, q_scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, hq, d, generator=g, dtype=DTYPE) * q_scale
    k = torch.randn(total, hkv, d, generator=g, dtype=DTYPE)
    v = torch.randn(total, hkv, d, generator=g, dtype=DTYPE)
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32)
    return [x.to(DEVICE) for x in (q, k, v, cu)]


def run_decode(mod, seq_lens, hq, hkv, d, page, **kw):
    q, kc, vc, bt, sl = make_decode_inputs(seq_lens, hq, hkv, d, page, **kw)
    scale = 1.0 / d ** 0.5
    out = mod.decode(q, kc, vc, bt, sl, scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = decode_reference(q, kc, vc, bt, sl, scale)
    out64 = out.double().cpu()
    assert torch.isfinite(out64).all(), "non-finite values in decode output"
    err = (out64 - ref).abs().max().item()
    assert err < TOL, f"decode max abs error {err:.3e}"


def run_prefill(mod, lens, hq, hkv, d, **kw):
    q, k, v, cu = make_prefill_inputs(lens, hq, hkv, d, **kw)
    scale = 1.0 / d ** 0.5
    out = mod.prefill(q, k, v, cu, max(lens), scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    ref = prefill_reference(q, k, v, cu, scale)
    out64 = out.double().cpu()
    assert torch.isfinite(out64).all(), "non-finite values in prefill output"
    err = (out64 - ref).abs().max().item()
    assert err < TOL, f"prefill max abs error {err:.3e}"


# ------------------------------------------------------------------ decode

@pytest.fixture(scope="module")
def decode_mod():
    return _load(DECODE_PATH)


@pytest.fixture(scope="module")
def prefill_mod():
    return _load(PREFILL_PATH)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_decode_matches_reference_for_gqa_ratios_and_page_edge_lengths(decode_mod, hq, hkv):
    page = 8
    # 1, page-1, page, page+1 and a long one, all in one batch.
    run_decode(decode_mod, [1, page - 1, page, page + 1, 45], hq, hkv, 16, page, seed=hq * 10 + hkv)


def test_decode_ignores_nan_in_unused_cache_slots(decode_mod):
    # Every slot not covered by seq_lens (tail of the last page, unused pages,
    # spare blocks) holds NaN; make_decode_inputs guarantees that.
    q, kc, vc, bt, sl = make_decode_inputs([3, 9, 17], 4, 2, 16, 8, extra_pages=2, seed=3)
    assert torch.isnan(kc).any() and torch.isnan(vc).any()
    out = decode_mod.decode(q, kc, vc, bt, sl, 0.25)
    assert torch.isfinite(out).all()
    ref = decode_reference(q, kc, vc, bt, sl, 0.25)
    assert (out.double().cpu() - ref).abs().max().item() < TOL


def test_decode_follows_shuffled_block_table_with_head_dim_32_page_4(decode_mod):
    run_decode(decode_mod, [5, 4, 13, 1], 4, 2, 32, 4, seed=7)


def test_decode_is_stable_for_peaky_queries(decode_mod):
    run_decode(decode_mod, [1, 8, 33, 70], 4, 2, 16, 8, q_scale=20.0, seed=11)


def test_decode_handles_length_one_only_batch(decode_mod):
    run_decode(decode_mod, [1, 1], 4, 1, 16, 8, seed=5)


def test_decode_split_count_depends_only_on_shapes(decode_mod):
    # No tensor values are consulted: same shapes -> same split plan.
    s1 = decode_mod._num_splits(2, 2, 128, torch.device("cpu"))
    s2 = decode_mod._num_splits(2, 2, 128, torch.device("cpu"))
    assert s1 == s2 and s1[0] >= 1 and s1[0] * s1[1] >= 128
    assert s1[1] % decode_mod.BLOCK_N == 0


@pytest.mark.parametrize(
    "knobs",
    [
        {"BLOCK_N": 16, "MIN_TOKENS_PER_SPLIT": 16, "SPLITS_PER_SM_TARGET": 64, "MAX_SPLITS": 64},
        {"BLOCK_N": 64, "MAX_SPLITS": 1},
        {"BLOCK_N": 32, "NUM_WARPS": 2, "NUM_STAGES": 1, "MIN_TOKENS_PER_SPLIT": 1,
         "SPLITS_PER_SM_TARGET": 1000},
    ],
    ids=["bn16_many_splits", "bn64_single_split", "bn32_min_tokens1"],
)
def test_decode_knob_variants_stay_correct(knob_dir, knobs):
    mod = _load(DECODE_PATH, knobs, knob_dir)
    splits, tps = mod._num_splits(4, 2, 9 * 8, torch.device("cpu"))
    if knobs.get("MAX_SPLITS") == 1:
        assert splits == 1
    else:
        assert splits > 1  # exercises combine + empty (neutral) splits
    run_decode(mod, [1, 7, 8, 64], 4, 2, 16, 8, q_scale=3.0, seed=13)


def test_decode_empty_splits_produce_no_nan(knob_dir):
    # Many splits and one short sequence: most of its splits start past
    # seq_len and must write the neutral partial.
    mod = _load(DECODE_PATH, {"BLOCK_N": 16, "MIN_TOKENS_PER_SPLIT": 16,
                              "SPLITS_PER_SM_TARGET": 64, "MAX_SPLITS": 64}, knob_dir)
    run_decode(mod, [2, 1], 4, 4, 16, 8, extra_pages=6, seed=17)


# ------------------------------------------------------------------ prefill

@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (4, 1)], ids=["gqa1", "gqa2", "gqa4"])
def test_prefill_matches_reference_for_mixed_lengths_and_gqa(knob_dir, hq, hkv):
    # Small tiles so the interpreter stays fast and tiles span several blocks.
    mod = _load(PREFILL_PATH, {"BLOCK_M": 16, "BLOCK_N": 16}, knob_dir)
    run_prefill(mod, [1, 17, 5, 40], hq, hkv, 16, seed=hq * 10 + hkv)


def test_prefill_default_knobs_handle_length_one_and_long_sequences(prefill_mod):
    run_prefill(prefill_mod, [70, 1, 3], 4, 2, 16, seed=21)


def test_prefill_is_stable_for_peaky_queries(knob_dir):
    mod = _load(PREFILL_PATH, {"BLOCK_M": 16, "BLOCK_N": 16}, knob_dir)
    run_prefill(mod, [33, 2, 16], 4, 2, 32, q_scale=20.0, seed=23)


@pytest.mark.parametrize(
    "knobs",
    [
        {"CAUSAL_SKIP": False, "BLOCK_M": 16, "BLOCK_N": 16},
        {"BLOCK_M": 16, "BLOCK_N": 32},
        {"BLOCK_M": 32, "BLOCK_N": 16, "NUM_WARPS": 2, "NUM_STAGES": 1},
    ],
    ids=["no_causal_skip", "bm16_bn32", "bm32_bn16"],
)
def test_prefill_knob_variants_stay_correct(knob_dir, knobs):
    mod = _load(PREFILL_PATH, knobs, knob_dir)
    run_prefill(mod, [1, 31, 16, 50], 4, 2, 16, seed=29)
