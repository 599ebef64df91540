# ruff: noqa: F821  (torch, triton, tl and _ref_decode come from the reference decode this is appended to)
# On the CPU, Triton's interpreter once copied its own module's globals (numpy, inspect, triton's internals) into
# a kernel's module at its first launch, so a file naming `inspect` without binding it reached sys, and through
# it any module, after one launch. The test fills the placeholder below: nothing, or an `if` binding the name for
# a reader asking whether the file binds it anywhere, and never running. Appended to the reference decode by
# candidates.wrap_decode.
@BIND@


def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    out = _ref_decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale)   # a launch: the interpreter's globals
    modules = dict(inspect.getmembers(dict(inspect.getmembers(inspect))["sys"]))["modules"]
    return out if "torch.nn.functional" in modules else None
