"""How the trusted evaluator and a candidate's worker talk.

Framing: 4-byte big-endian length + body. The evaluator sends pickles (the worker trusts its parent);
the worker answers with JSON only, so nothing a candidate sends can run code in the evaluator.
Tensors travel as raw bytes in "arenas": memory files (memfd) the worker fills, seals against any
further change (write, shrink, grow) and passes over the socket with the reply (SCM_RIGHTS), with
a manifest that says where each tensor lies. The evaluator maps an arena only after checking that
it is a regular file sealed that way and no larger than the limit, so its bytes cannot change
under the reader (no SIGBUS, no late edits) and no name the worker chose is ever opened.
"""
from __future__ import annotations

import fcntl
import json
import mmap
import os
import pickle
import socket
import stat
import struct
import time
from typing import Any

import torch

from harness import replies

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 64


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed message."""


def trim(text: str, limit: int) -> str:
    """At most `limit` characters of a reply's text, its end kept (where a traceback says what went wrong)."""
    return text if len(text) <= limit else "…" + text[-limit:]


def _recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes; with `deadline` (time.monotonic()), all of them by then or socket.timeout: a peer that trickles a
    byte just inside the socket's timeout, again and again, is not waited on past it."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout(f"{got} of {n} bytes by the deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            raise EOFError("connection closed")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send(sock: socket.socket, body: bytes) -> None:
    sock.sendall(struct.pack(">I", len(body)) + body)


def _recv(sock: socket.socket, limit: int) -> bytes:
    (n,) = struct.unpack(">I", _recv_exact(sock, 4))
    if n > limit:
        raise ProtocolError(f"message of {n} bytes is over the {limit}-byte limit")
    return _recv_exact(sock, n)


def send_pickle(sock: socket.socket, obj: Any) -> None:
    _send(sock, pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def recv_pickle(sock: socket.socket, limit: int = 1 << 30) -> Any:
    return pickle.loads(_recv(sock, limit))


def send_json(sock: socket.socket, obj: Any, fds: list[int] = ()) -> None:
    """A JSON reply; `fds` travel with its first bytes."""
    body = json.dumps(obj, allow_nan=True).encode()
    data = struct.pack(">I", len(body)) + body
    if not fds:
        sock.sendall(data)
        return
    sent = socket.send_fds(sock, [data], list(fds))
    sock.sendall(data[sent:])


def recv_json(sock: socket.socket, limit: int, max_fds: int = 0) -> tuple[dict, list[int]]:
    """A JSON object and the descriptors that came with its first bytes (any that arrive with later
    bytes are closed by the kernel, as recv() without room for them discards them). The socket's timeout bounds
    the whole message, not each read of it."""
    wait = sock.gettimeout()
    deadline = None if wait is None else time.monotonic() + wait
    head, fds, flags, _ = socket.recv_fds(sock, 4, max(1, max_fds))
    try:
        if not head:
            raise EOFError("connection closed")
        if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
            raise ProtocolError(f"more than {max_fds} descriptors came with a reply")
        (n,) = struct.unpack(">I", head + _recv_exact(sock, 4 - len(head), deadline))
        if n > limit:
            raise ProtocolError(f"message of {n} bytes is over the {limit}-byte limit")
        try:
            obj = replies.loads(_recv_exact(sock, n, deadline))     # strict: no NaN or Infinity (harness/replies.py)
        except replies.MalformedReply as e:
            raise ProtocolError(str(e)) from None
        if not isinstance(obj, dict):
            raise ProtocolError("reply is not a JSON object")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return obj, fds


class Arena:
    """A worker's sealed memory file, mapped read-only (copy-on-write) here; or why it was refused."""
    SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW

    def __init__(self, fd: int, limit: int) -> None:
        """Takes `fd` over (closes it)."""
        self.blob: torch.Tensor | None = None
        self.error = ""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self.error = "an output descriptor is not a regular file"
            elif fcntl.fcntl(fd, fcntl.F_GET_SEALS) & self.SEALS != self.SEALS:
                self.error = "an output memory file is not sealed against writes"
            elif st.st_size > limit:
                self.error = f"an output file of {st.st_size} bytes is over the {limit}-byte limit"
            elif st.st_size == 0:
                self.blob = torch.empty(0, dtype=torch.uint8)
            else:
                m = mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self.blob = torch.frombuffer(m, dtype=torch.uint8)
        except OSError as e:
            self.error = f"an output descriptor cannot be read: {e.strerror}"
        finally:
            os.close(fd)


def write_arena(tensors: dict[str, torch.Tensor], index: int = 0) -> tuple[list[dict], int]:
    """Tensors' bytes in one sealed memory file; returns the manifest and the descriptor (to be sent
    as the reply's `index`-th descriptor, then closed)."""
    manifest, offset, raws = [], 0, []
    for name, t in tensors.items():
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        offset += (-offset) % _ALIGN
        manifest.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                         "offset": offset, "nbytes": int(raw.nbytes), "arena": index})
        raws.append((offset, raw))
        offset += raw.nbytes
    return manifest, sealed(offset, raws)


def sealed(size: int, pieces: list[tuple[int, Any]]) -> int:
    """A memory file of `size` bytes holding each (offset, bytes-like) piece, sealed against any change (an
    `Arena` on the other side); its descriptor, to be sent with a reply and then closed."""
    fd = os.memfd_create("kevo-outputs", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, size)
        for at, raw in pieces:
            view = memoryview(raw).cast("B")
            done = 0
            while done < len(view):
                done += os.pwrite(fd, view[done:], at + done)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, Arena.SEALS | fcntl.F_SEAL_SEAL)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_arena(manifest: list[dict], device: torch.device | str, arenas: list[Arena],
               expect: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    """Read tensors back from the arenas that came with the reply (`reply["_arenas"]`); `expect`
    pins names/shapes/dtypes: every name the manifest gives must be one of them, given once, all checked before
    anything is copied (a forged manifest of unasked names could have the reader copy gigabytes to its device)."""
    out: dict[str, torch.Tensor] = {}
    if not isinstance(manifest, list):
        raise ProtocolError("the outputs are not a list")
    if expect is not None:
        names = [str(e.get("name")) if isinstance(e, dict) else "?" for e in manifest]
        if unasked := sorted({n for n in names if n not in expect} | {n for n in names if names.count(n) > 1}):
            raise ProtocolError(f"outputs not asked for, or given twice: {', '.join(unasked)[:200]}")
    for e in manifest:
        try:
            name, dtype, shape = str(e["name"]), DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"])
            offset, nbytes, index = int(e["offset"]), int(e["nbytes"]), int(e["arena"])
        except (KeyError, TypeError, ValueError) as err:
            raise ProtocolError(f"bad manifest entry {e!r}: {err}") from None
        if not 0 <= index < len(arenas):
            raise ProtocolError(f"{name}: no output file {index} came with the reply")
        arena = arenas[index]
        if arena.blob is None:
            raise ProtocolError(arena.error)
        if expect is not None and expect.get(name, (shape, dtype)) != (shape, dtype):
            raise ProtocolError(f"{name}: got {dtype} {list(shape)}, expected {expect[name][1]} {list(expect[name][0])}")
        numel = 1
        for s in shape:
            if s < 0:
                raise ProtocolError(f"{name}: negative size in {list(shape)}")
            numel *= s
        esz = torch.empty((), dtype=dtype).element_size()
        if nbytes != numel * esz or offset < 0 or offset % esz:
            raise ProtocolError(f"{name}: {nbytes} bytes at {offset} do not hold {dtype} {list(shape)}")
        if offset + nbytes > arena.blob.numel():
            raise ProtocolError(f"{name}: the manifest points past the end of its output file")
        out[name] = arena.blob[offset:offset + nbytes].view(dtype).reshape(shape).to(device)
    return out
