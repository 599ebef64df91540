"""How the trusted evaluator and a candidate's worker talk.

Framing: 4-byte big-endian length + body. The evaluator sends pickles (the worker trusts its parent);
the worker answers with JSON only, so nothing a candidate sends can run code in the evaluator.
Tensors travel as raw bytes in "arena" files described by a manifest; the reader checks every entry.
"""
from __future__ import annotations

import json
import os
import pickle
import socket
import struct
from pathlib import Path
from typing import Any

import torch

from harness import replies

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
          "float16": torch.float16, "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
_ALIGN = 64


class ProtocolError(Exception):
    """The other side sent something that is not a well-formed message."""


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    chunks, got = [], 0
    while got < n:
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


def send_json(sock: socket.socket, obj: Any) -> None:
    _send(sock, json.dumps(obj, allow_nan=True).encode())


def recv_json(sock: socket.socket, limit: int) -> dict:
    """One reply: strict JSON (no NaN or Infinity: harness/replies.py), an object; its schema is checked later."""
    try:
        obj = replies.loads(_recv(sock, limit))
    except replies.MalformedReply as e:
        raise ProtocolError(str(e)) from None
    if not isinstance(obj, dict):
        raise ProtocolError("reply is not a JSON object")
    return obj


def write_arena(path: Path, tensors: dict[str, torch.Tensor]) -> list[dict]:
    """Write tensors' bytes to one file; return the manifest that describes them."""
    manifest, offset = [], 0
    with open(path, "wb") as f:
        for name, t in tensors.items():
            raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
            pad = (-offset) % _ALIGN
            f.write(b"\0" * pad)
            offset += pad
            f.write(raw.tobytes())
            manifest.append({"name": name, "dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                             "offset": offset, "nbytes": int(raw.nbytes), "file": str(path)})
            offset += raw.nbytes
    return manifest


def read_arena(manifest: list[dict], device: torch.device | str = "cpu", within: Path | None = None,
               expect: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None) -> dict[str, torch.Tensor]:
    """Read tensors back. `within` confines the files to one folder; `expect` pins names/shapes/dtypes."""
    out: dict[str, torch.Tensor] = {}
    cache: dict[str, torch.Tensor] = {}
    for e in manifest:
        try:
            name, dtype, shape = str(e["name"]), DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"])
            offset, nbytes, file = int(e["offset"]), int(e["nbytes"]), Path(e["file"])
        except (KeyError, TypeError, ValueError) as err:
            raise ProtocolError(f"bad manifest entry {e!r}: {err}") from None
        if within is not None and not file.resolve().is_relative_to(within.resolve()):
            raise ProtocolError(f"output file {file} is outside the worker's folder")
        if expect is not None and expect.get(name, (shape, dtype)) != (shape, dtype):
            raise ProtocolError(f"{name}: got {dtype} {list(shape)}, expected {expect[name][1]} {list(expect[name][0])}")
        numel = 1
        for s in shape:
            numel *= s
        esz = torch.empty((), dtype=dtype).element_size()
        if nbytes != numel * esz or offset < 0:
            raise ProtocolError(f"{name}: {nbytes} bytes do not hold {dtype} {list(shape)}")
        if str(file) not in cache:
            fd = os.open(file, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            cache[str(file)] = torch.from_file(str(file), shared=False, size=size, dtype=torch.uint8)
        blob = cache[str(file)]
        if offset + nbytes > blob.numel():
            raise ProtocolError(f"{name}: manifest points past the end of {file.name}")
        out[name] = blob[offset:offset + nbytes].view(dtype).reshape(shape).to(device)
    return out
