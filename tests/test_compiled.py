"""A source's compiled kernels kept for its next sandbox (harness/compiled.py): packed and unpacked only inside
sandboxes, checked name by name on the way in, kept here as opaque bytes, and handed only to a process that runs
every source whose process packed them: through a real sandboxed worker, a real served process, and a replay's
servers side by side (on the CPU, where Triton's interpreter compiles nothing, the tests plant the files)."""
from __future__ import annotations

import http.server
import struct
import threading
import time
import zlib
from pathlib import Path

import pytest

import candidates as C
from conftest import CPU_GATES, config_with, runtime_only
from harness import compiled
from harness.compiled import CarryRefused, Kept, carry_in, carry_out, pack, unpack
from harness.evaluate import evaluate
from harness.isolation import FOLDER
from harness.lease import Parked
from harness.served.launch import ServerHandle, start_server
from harness.stages.arms import Servers
from harness.stages.carry import keep_worker

NO_ROOT = "no private root here (worker.sandbox best_effort without namespaces): nothing carries"
CACHE = {"ABCDEF234567": {"kern.cubin": b"\x7fELF" + bytes(range(256)) * 40, "kern.json": b'{"name": "kern"}',
                          "__grp__kern.json": b'{"child_paths": {}}'},
         "ZYXW_-9": {"other.ptx": b".version 8.0\n" * 300}}


def _plant(folder: Path, files: dict[str, dict[str, bytes]] = CACHE) -> None:
    for key, named in files.items():
        (folder / compiled.SUBFOLDER / key).mkdir(parents=True, exist_ok=True)
        for name, data in named.items():
            (folder / compiled.SUBFOLDER / key / name).write_bytes(data)


def _read(folder: Path) -> dict[str, dict[str, bytes]]:
    cache = folder / compiled.SUBFOLDER
    return {d.name: {f.name: f.read_bytes() for f in d.iterdir()} for d in cache.iterdir()} if cache.is_dir() else {}


def _blob(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A blob in the packed format with entries of our choosing (what a hostile process could pack)."""
    raw = compiled._MAGIC + b"".join(struct.pack(">HI", len(n), len(d)) + n + d for n, d in entries)
    return zlib.compress(raw)


def _writes_its_cache(key: str, source: str) -> str:
    """`source`, writing a file into its own Triton cache folder as it is imported (once: a process that finds the
    file there, carried in, leaves it)."""
    return f"""
import os
try:
    os.mkdir(os.environ["TRITON_CACHE_DIR"] + "/{key}")
    with open(os.environ["TRITON_CACHE_DIR"] + "/{key}/k.cubin", "wb") as _f:
        _f.write(b"{key}")
except FileExistsError:
    pass
""" + source


def test_a_packed_cache_unpacks_to_the_same_files_and_leaves_links_deeper_folders_and_temporary_ones_behind(tmp_path):
    src, dst = tmp_path / "a", tmp_path / "b"
    _plant(src)
    cache = src / compiled.SUBFOLDER
    (cache / "ABCDEF234567" / "passwd").symlink_to("/etc/passwd")
    (cache / "tmp.pid_7_x").mkdir()
    (cache / "tmp.pid_7_x" / "half.cubin").write_bytes(b"half")
    (cache / "ZYXW_-9" / "deeper").mkdir()
    (cache / "ZYXW_-9" / "deeper" / "f").write_bytes(b"f")
    blob = pack(str(src), 1 << 20)
    assert 0 < len(blob) < sum(len(d) for files in CACHE.values() for d in files.values())   # compressed
    (dst / compiled.SUBFOLDER).mkdir(parents=True)
    files, size = unpack(blob, str(dst), 1 << 20)
    assert _read(dst) == CACHE
    assert files == 4 and size == sum(len(d) for named in CACHE.values() for d in named.values())


def test_nothing_is_packed_from_an_empty_cache_or_over_the_limit(tmp_path):
    assert pack(str(tmp_path), 1 << 20) == b""
    _plant(tmp_path)
    assert pack(str(tmp_path), 1 << 20) != b""
    assert pack(str(tmp_path), 64) == b""


@pytest.mark.parametrize("name", [b"../escape", b"ABC/../../escape", b"ABC/sub/deep", b"/abs/x", b".hidden/x", b"ABC/.x",
                                  b"ABC", b"tmp.pid_1/x", b"ABC/" + b"x" * 200, b"A\x00B/x"])
def test_a_name_that_is_not_a_key_folders_file_is_refused_and_nothing_lands_outside_the_cache(tmp_path, name):
    folder = tmp_path / "box"
    (folder / compiled.SUBFOLDER).mkdir(parents=True)
    with pytest.raises(CarryRefused, match="not a cache folder's file"):
        unpack(_blob([(b"GOOD/first.json", b"{}"), (name, b"payload")]), str(folder), 1 << 20)
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*")) == \
        ["box", "box/triton", "box/triton/GOOD", "box/triton/GOOD/first.json"]


def test_what_is_not_a_packed_cache_is_refused_in_one_line(tmp_path):
    folder = str(tmp_path)
    (tmp_path / compiled.SUBFOLDER).mkdir()
    cases = {b"not zlib at all": "not a packed cache", zlib.compress(b"no header here"): "no header",
             _blob([(b"ABC/x", b"12345")])[:-6]: "cut short", _blob([(b"ABC/x", b"1")]) + b"more": "followed by",
             zlib.compress(compiled._MAGIC + struct.pack(">HI", 5, 100) + b"ABC/x" + b"short"): "cut short",
             zlib.compress(compiled._MAGIC + b"\x00"): "cut short",
             _blob([(b"ABC/x", b"\x00" * (compiled.RATIO * 4096))]): "unpacks to more than",
             b"x" * 5000: "over the 4096-byte limit"}
    for blob, words in cases.items():
        with pytest.raises(CarryRefused) as e:
            unpack(blob, folder, 4096)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_a_file_already_there_is_kept_and_the_rest_of_the_blob_still_lands(tmp_path):
    (tmp_path / compiled.SUBFOLDER / "ABC").mkdir(parents=True)
    (tmp_path / compiled.SUBFOLDER / "ABC" / "k.cubin").write_bytes(b"first")
    assert unpack(_blob([(b"ABC/k.cubin", b"second"), (b"ABC/k.json", b"{}")]), str(tmp_path), 1 << 20) == (1, 2)
    assert _read(tmp_path) == {"ABC": {"k.cubin": b"first", "k.json": b"{}"}}


def test_a_blob_goes_only_to_a_process_running_every_source_whose_process_packed_it():
    kept = Kept(keep=3)
    cand, head, other = "def decode(): 1\n", "def decode(): 2\n", "def prefill(): 3\n"
    kept.keep_from([cand], b"C")
    kept.keep_from([head, other], b"HP")
    kept.keep_from([other, None], b"P")
    assert kept.given([cand, other]) == [b"C", b"P"]          # its own worker's, and the other head's alone
    assert kept.given([head, other]) == [b"P", b"HP"]
    assert kept.given([head]) == [] and kept.given([None]) == [] and kept.given([]) == []
    assert kept.given(["def decode(): 1 \n", other]) == [b"P"]   # a byte's difference is another source
    kept.keep_from([cand], b"C2")                             # the same set again: replaced
    assert kept.given([cand]) == [b"C2"] and len(kept) == 3
    kept.keep_from([None], b"torch's")                        # no source ran: nothing to key it by
    kept.keep_from([head], b"")
    assert len(kept) == 3
    kept.given([head, other])                                 # used: the least recently used is now the candidate's
    kept.keep_from(["def decode(): 4\n"], b"D")
    assert kept.given([cand]) == [] and kept.given([head, other]) == [b"P", b"HP"]


def test_a_process_without_a_private_root_carries_nothing_in_or_out(tmp_path):
    _plant(tmp_path)
    blob = pack(str(tmp_path), 1 << 20)
    other = tmp_path / "other"
    assert carry_in([blob], str(other), 1 << 20) == (0, "") and not other.exists()
    assert carry_out(str(tmp_path), 1 << 20) == b""
    assert FOLDER != str(tmp_path)


NEEDS_ITS_CACHE = """
import os
cache = os.environ["TRITON_CACHE_DIR"]
assert os.path.isfile(os.path.join(cache, "ABCDEF234567", "kern.cubin")), f"not carried in: {os.listdir(cache)}"
with open(os.path.join(cache, "ABCDEF234567", "mine.cubin"), "wb") as f:
    f.write(b"compiled by this worker")

def decode(q, k_cache, v_cache, block_table, seq_lens, sm_scale):
    return q
"""


def test_a_sandboxed_worker_unpacks_what_it_is_handed_before_its_candidate_loads_and_packs_what_it_adds(cfg, pool, tmp_path):
    _plant(tmp_path)
    blob = pack(str(tmp_path), cfg.worker.carry_bytes)
    handle = pool.spawn(NEEDS_ITS_CACHE)
    try:
        if str(handle.workdir) != FOLDER:
            pytest.skip(NO_ROOT)
        reply = handle.request({"cmd": "load", "path": f"{FOLDER}/candidate.py", "carried": [blob, b"junk"],
                                "carry_bytes": cfg.worker.carry_bytes}, 60, "loading")
        assert reply["ok"], reply["error"]
        assert reply["carried"] == 4 and "a carried cache was refused: not a packed cache" in reply["carry_refused"]
        assert keep_worker(cfg, handle, NEEDS_ITS_CACHE) > 0
    finally:
        handle.close()
    back = compiled.KEPT.given([NEEDS_ITS_CACHE])
    assert len(back) == 1
    out = tmp_path / "out"
    (out / compiled.SUBFOLDER).mkdir(parents=True)
    unpack(back[0], str(out), cfg.worker.carry_bytes)
    want = {k: dict(v) for k, v in CACHE.items()}
    want["ABCDEF234567"]["mine.cubin"] = b"compiled by this worker"
    assert _read(out) == want


def test_a_sandboxed_server_unpacks_what_it_is_handed_reports_a_refused_blob_and_packs_its_cache_on_request(tmp_path):
    cfg = config_with()
    _plant(tmp_path)
    blob = pack(str(tmp_path), cfg.worker.carry_bytes)
    with start_server(cfg, "cpu", C.REF_DECODE, carried=[blob, _blob([(b"../x", b"!")])]) as s:
        notes = s.stats()["sandbox"]
        if "private root" not in notes:
            pytest.skip(NO_ROOT)
        back = s.compiled(cfg.worker.carry_bytes)
        assert s.compiled(16) == b""                          # more than the limit: nothing
    assert "compiled files carried in: 4" in notes and "a carried cache was refused: a file named b'../x'" in notes
    out = tmp_path / "out"
    (out / compiled.SUBFOLDER).mkdir(parents=True)
    unpack(back, str(out), cfg.worker.carry_bytes)
    assert _read(out) == CACHE


def test_a_replays_head_server_is_handed_nothing_its_candidate_packed_and_each_server_keeps_its_own(tmp_path):
    """Through the replay's servers side by side (the CPU's reference, head and candidate): the candidate's blob
    reaches the candidate's server only; a blob of the head and the other op's head reaches the head's server only;
    on stopping, each server's cache is kept under its own sources."""
    cfg = config_with()
    cand, head, other = C.REBLOCKED, C.REF_DECODE, C.REF_PREFILL
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    _plant(mine, {"CANDIDATEPOISON": {"kern.cubin": b"the candidate's"}})
    _plant(theirs, {"HEADKEY": {"kern.cubin": b"the head's"}})
    compiled.KEPT.keep_from([cand], pack(str(mine), cfg.worker.carry_bytes))
    compiled.KEPT.keep_from([head, other], pack(str(theirs), cfg.worker.carry_bytes))
    try:
        with Servers(cfg, "cpu", {"reference": None, "head": head, "candidate": cand}, 7,
                     other_heads={"prefill": other}) as servers:
            notes = {label: h.stats()["sandbox"] for label, h in servers.handles.items()}
            carried = servers.carried_mib()
        if "private root" not in notes["candidate"]:
            pytest.skip(NO_ROOT)
        assert set(carried) == {"head_carried_mib", "candidate_carried_mib"}
        assert "compiled files carried in: 1" in notes["candidate"] and "compiled files carried in: 1" in notes["head"]
        assert "carried" not in notes["reference"]
        for sources, key in (([cand, other], "CANDIDATEPOISON"), ([head, other], "HEADKEY")):
            blobs = compiled.KEPT.given(sources)
            out = tmp_path / key
            (out / compiled.SUBFOLDER).mkdir(parents=True)
            for blob in blobs:
                unpack(blob, str(out), cfg.worker.carry_bytes)
            assert list(_read(out)) == [key]
    finally:
        compiled.KEPT.clear()


def test_with_the_carry_off_a_server_is_handed_nothing_and_nothing_is_kept(tmp_path):
    cfg = config_with(**{"worker.carry_bytes": 0})
    _plant(tmp_path)
    blob = pack(str(tmp_path), 1 << 20)
    compiled.KEPT.keep_from([C.REF_DECODE], blob)
    try:
        with Servers(cfg, "cpu", {"candidate": C.REF_DECODE}, 7) as servers:
            notes = servers.handles["candidate"].stats()["sandbox"]
            assert servers.carried_mib() == {}
        assert "carried" not in notes and compiled.KEPT.given([C.REF_DECODE]) == [blob]
    finally:
        compiled.KEPT.clear()


WRITES_ITS_CACHE = _writes_its_cache("WORKERMADE", C.REF_DECODE)     # in its worker; its server finds it carried in


def test_a_server_that_trickles_its_packed_cache_or_its_accounting_is_given_up_on_within_the_bound():
    """A candidate's server may answer GET /kevo/compiled or /kevo/stats a byte at a time: the trusted side stops
    reading at its bound and takes nothing (each read alone would be within the socket's timeout)."""
    class Trickle(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "1000000")
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Trickle)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        h = ServerHandle(None, f"http://127.0.0.1:{httpd.server_address[1]}/v1", "m", Path("/nonexistent"), False, 0, -1)
        t0 = time.monotonic()
        assert h.compiled(1 << 20, within_s=1.0) == b""
        assert time.monotonic() - t0 < 2.0
        t0 = time.monotonic()
        assert h.stats(within_s=1.0) is None
        assert time.monotonic() - t0 < 2.0
    finally:
        httpd.shutdown()


def test_a_replays_servers_are_handed_the_candidates_worker_kernels_and_every_head_compiled_once_alone(pool, tmp_path):
    """Through the staged evaluator: before the first replay's servers start, the candidate's worker packs what it
    compiled, and the head it is judged against and the head of the op it does not define are each compiled in a
    worker of their own (parity's warm of their ops), each kept under its own source; the candidate's server is
    handed exactly its worker's and the other op's head's; the next candidate's replay compiles no head again. (On
    a CPU the gates serve no head arm: the decode head's blob is read back from what is kept.)"""
    cfg = runtime_only(**CPU_GATES, **{"stages.parity.warm_threads.cpu": 1})
    head, other = _writes_its_cache("DECODEHEAD", C.REF_DECODE), _writes_its_cache("PREFILLHEAD", C.REF_PREFILL)
    compiled.KEPT.clear()
    try:
        first, second = (list(evaluate(source, "attention", cfg, pool, until="replay", head=head,
                                       other_heads={"prefill": other}).stages) for source in (WRITES_ITS_CACHE, C.REBLOCKED))
        kept = {key: compiled.KEPT.given([source]) for key, source in
                (("WORKERMADE", WRITES_ITS_CACHE), ("DECODEHEAD", head), ("PREFILLHEAD", other))}
    finally:
        compiled.KEPT.clear()
    if "private root" not in first[0].reason:
        pytest.skip(NO_ROOT)
    assert first[-1].name == second[-1].name == "replay" and first[-1].status == second[-1].status == "passed"
    assert first[-1].metrics["heads_compiled_alone_s"] > 0 and "heads_compiled_alone_s" not in second[-1].metrics
    assert first[-1].metrics["candidate_carried_mib"] * (1 << 20) == len(kept["WORKERMADE"][0]) + len(kept["PREFILLHEAD"][0])
    assert second[-1].metrics["candidate_carried_mib"] * (1 << 20) == len(kept["PREFILLHEAD"][0])
    for key, blobs in kept.items():
        assert len(blobs) == 1
        out = tmp_path / key
        (out / compiled.SUBFOLDER).mkdir(parents=True)
        unpack(blobs[0], str(out), 1 << 20)
        assert _read(out) == {key: {"k.cubin": key.encode()}}


def test_a_parked_jobs_worker_keeps_what_it_compiled_and_the_jobs_next_run_here_is_handed_it(pool):
    """A replay parks another slot's job where it asks for its next stage (harness/lease.py): before its worker is
    closed it packs what it compiled, so the job's next run in this slot process starts from it, as its later stages
    would have; the park itself still ends the job."""
    cfg, source = runtime_only(), _writes_its_cache("PARKEDJOB", C.REF_DECODE)    # past the allowlist: it names os

    def park_at_parity(name: str) -> None:
        if name == "parity":
            raise Parked(name)
    compiled.KEPT.clear()
    try:
        with pytest.raises(Parked):
            evaluate(source, "attention", cfg, pool, until="parity", on_stage=park_at_parity)
        kept = compiled.KEPT.given([source])
        again = evaluate(source, "attention", cfg, pool, until="compile")
    finally:
        compiled.KEPT.clear()
    if "private root" not in again.stages[0].reason:
        pytest.skip(NO_ROOT)
    assert len(kept) == 1 and again.stages[0].metrics["carried_files"] == 1, again.stages[0].metrics
