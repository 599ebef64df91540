"""tests/bench/sm90_compile.py for the suite's sm90 checks, in one child process per pytest process: each test's
call is that script's `main` on its arguments, run in the child, its printed lines handed back. The compiler's work
is the script's, as it does it for several specs in one run; what one child saves is the import of torch and
triton (and Triton's compiler) per call, a few seconds each of some twenty calls. A child that dies or hangs on a
call fails that call, naming why, and the next call starts a fresh one.

    python tests/sm90_child.py FD        the child: a JSON list of arguments a line on stdin, a JSON reply a line on FD
"""
from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import selectors
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

SM90_COMPILE = Path(__file__).resolve().parent / "bench" / "sm90_compile.py"
_child: dict = {}


def _serve(fd: int) -> None:
    sys.path.insert(0, str(SM90_COMPILE.parent))
    import sm90_compile                 # pops TRITON_INTERPRET: the real compiler
    with os.fdopen(fd, "w") as replies:
        for line in sys.stdin:
            out, rc = io.StringIO(), 0
            try:
                with contextlib.redirect_stdout(out):
                    rc = sm90_compile.main(json.loads(line)) or 0
            except SystemExit as e:
                rc = e.code if isinstance(e.code, int) else 1
            except BaseException:       # noqa: BLE001 - the caller's failure, said in its words
                out.write(traceback.format_exc())
                rc = 1
            replies.write(json.dumps({"rc": rc, "out": out.getvalue()}) + "\n")
            replies.flush()


def _start() -> dict:
    read, write = os.pipe()
    fd, err = tempfile.mkstemp(prefix="sm90_child_", suffix=".err")
    os.close(fd)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    with open(err, "ab") as stderr:     # appended to: each call's own part is read from where it began
        proc = subprocess.Popen([sys.executable, __file__, str(write)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                stderr=stderr, env=env, text=True, pass_fds=(write,))
    os.close(write)
    child = {"proc": proc, "replies": os.fdopen(read), "err": Path(err)}
    atexit.register(_stop, child)
    return child


def _stop(child: dict) -> None:
    if child["proc"].poll() is None:
        child["proc"].kill()
    child["proc"].wait()
    child["replies"].close()
    child["err"].unlink(missing_ok=True)
    if _child.get("now") is child:
        del _child["now"]


def _stderr(child: dict, since: int) -> str:
    """What the child wrote to its stderr from `since` (bytes), its last 2000 characters."""
    with open(child["err"], "rb") as f:
        f.seek(since)
        return f.read().decode(errors="replace")[-2000:]


def run(args: list[str], timeout: float = 300.0) -> str:
    """sm90_compile.py's output on `args`, as its command line would print it; a failure raises AssertionError
    with its output and what the child wrote to stderr meanwhile (the compiler's own words)."""
    child = _child.get("now")
    if child is None or child["proc"].poll() is not None:
        child = _child["now"] = _start()
    since = child["err"].stat().st_size
    child["proc"].stdin.write(json.dumps(args) + "\n")
    child["proc"].stdin.flush()
    with selectors.DefaultSelector() as sel:
        sel.register(child["replies"], selectors.EVENT_READ)
        ready = sel.select(timeout)
    line = child["replies"].readline() if ready else ""
    said = _stderr(child, since)
    if not line:
        why = "hung" if not ready else f"ended ({child['proc'].poll()})"
        _stop(child)
        raise AssertionError(f"sm90_compile.py {' '.join(args)}: the child {why}: {said}")
    reply = json.loads(line)
    assert reply["rc"] == 0, f"sm90_compile.py {' '.join(args)} exited {reply['rc']}: {said}\n{reply['out'][-2000:]}"
    return reply["out"]


if __name__ == "__main__":
    _serve(int(sys.argv[1]))
