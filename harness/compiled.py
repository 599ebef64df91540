"""A source's compiled kernels, kept for its next sandbox: compile once (issue 19).

A process that runs candidate code compiles its Triton kernels into its own folder, /kevo/triton
(harness/isolation.py), and loses them when it ends: each replay compiled its head again from nothing, and the
candidate's server compiled again what its worker had compiled for parity (a served server's start, 71 s cold and
19 s from a filled cache on an H100: docs/BENCHMARKS.md, sixtieth session). So:
- the process packs that folder itself (`pack`, inside its sandbox: the bytes are the candidate's, never read here);
- the trusted side keeps the packed bytes as they are (`Kept`), under the set of sources whose code ran in the
  process that packed them (the candidate's, and the heads served beside it), and never looks inside;
- a later sandbox is handed every kept blob whose sources all run in it too (`Kept.given`), and unpacks them into
  its own folder inside its sandbox, before any candidate code is loaded (`unpack`, which checks every name, size
  and count and writes regular files only).
A blob therefore reaches only a process in which all the code that could have written it runs anyway: the same
candidate's server after its worker, the same head's server in the next replay; never another candidate, and
never the head's arm of a replay judging the candidate that wrote it (that arm does not run the candidate). The
replay's side of it (what is packed when, the heads compiled alone) is harness/stages/carry.py.
Only a private root carries (the folder is /kevo in every sandbox, and Triton's own files name their paths).
"""
from __future__ import annotations

import hashlib
import os
import re
import stat
import struct
import threading
import zlib
from collections import OrderedDict
from collections.abc import Iterable

from harness.isolation import FOLDER

SUBFOLDER = "triton"                                   # the cache Triton writes (TRITON_CACHE_DIR)
KEEP = 8                                               # sets of sources kept at once, the least recently used dropped
_MAGIC = b"kevo-compiled-1\n"
_ENTRY = struct.Struct(">HI")                          # the name's length, the file's length
_DIR = re.compile(r"[A-Za-z0-9_-]{1,128}")             # Triton's key folders (base32 hashes); not tmp.pid_* folders
_FILE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,159}")
MAX_FILES = 20000
RATIO = 16                                             # a blob of at most `limit` bytes unpacks to 16 times that at most


class CarryRefused(ValueError):
    """A blob that cannot be unpacked as it is: what was wrong, in one line."""


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def _names(cache: str) -> list[tuple[str, str]]:
    """The (folder, file) pairs of the cache worth carrying: regular files, two levels down, names as Triton makes
    them; everything else (links, a temporary folder mid-write, deeper levels) is left behind."""
    out = []
    try:
        folders = sorted(os.listdir(cache))
    except OSError:
        return []
    for d in folders:
        path = os.path.join(cache, d)
        if not _DIR.fullmatch(d) or not stat.S_ISDIR(os.lstat(path).st_mode):
            continue
        for f in sorted(os.listdir(path)):
            if _FILE.fullmatch(f) and stat.S_ISREG(os.lstat(os.path.join(path, f)).st_mode):
                out.append((d, f))
    return out


def pack(folder: str, limit: int) -> bytes:
    """The cache under `folder`, compressed (b"": nothing to carry, or more than `limit` bytes of it). Runs inside
    the sandbox of the process that compiled it."""
    cache = os.path.join(folder, SUBFOLDER)
    squeeze, parts, size, raw = zlib.compressobj(1), [], 0, len(_MAGIC)
    for d, f in _names(cache)[:MAX_FILES]:
        try:
            with open(os.path.join(cache, d, f), "rb") as fh:
                data = fh.read(limit + 1)
        except OSError:
            continue
        name = f"{d}/{f}".encode()
        parts.append(squeeze.compress((b"" if parts else _MAGIC) + _ENTRY.pack(len(name), len(data)) + name + data))
        size, raw = size + len(parts[-1]), raw + _ENTRY.size + len(name) + len(data)
        if size > limit or raw > RATIO * limit or len(data) > limit:
            return b""
    if not parts:
        return b""
    parts.append(squeeze.flush())
    blob = b"".join(parts)
    return blob if len(blob) <= limit else b""


def unpack(blob: bytes, folder: str, limit: int) -> tuple[int, int]:
    """Write a packed cache into `folder`'s own cache, inside the sandbox that will use it, before any candidate
    code is loaded: (files, bytes) written. Nothing but regular files in key folders is made, and nothing is
    overwritten (a file already there, from another blob, is kept). A blob that is not well formed raises
    CarryRefused, whatever it wrote before left in place (files a process of the same sources made, which Triton
    reads as its own cache)."""
    if len(blob) > limit:
        raise CarryRefused(f"{len(blob)} bytes, over the {limit}-byte limit")
    stream = zlib.decompressobj()
    try:
        raw = stream.decompress(blob, RATIO * limit + 1)
    except zlib.error as e:
        raise CarryRefused(f"not a packed cache ({e})") from None
    if len(raw) > RATIO * limit:
        raise CarryRefused(f"it unpacks to more than {RATIO * limit} bytes")
    if not stream.eof or stream.unused_data:
        raise CarryRefused("its compressed stream is cut short, or followed by more bytes")
    if not raw.startswith(_MAGIC):
        raise CarryRefused("not a packed cache (no header)")
    cache, at, files, wrote, seen = os.path.join(folder, SUBFOLDER), len(_MAGIC), 0, 0, 0
    while at < len(raw):
        seen += 1
        if at + _ENTRY.size > len(raw) or seen > MAX_FILES:
            raise CarryRefused(f"an entry is cut short at byte {at}" if seen <= MAX_FILES else f"over {MAX_FILES} files")
        n, size = _ENTRY.unpack_from(raw, at)
        at += _ENTRY.size
        name, data = raw[at:at + n], raw[at + n:at + n + size]
        at += n + size
        if len(data) != size:
            raise CarryRefused(f"an entry is cut short at byte {at}")
        parts = name.decode("ascii", "replace").split("/")
        if len(parts) != 2 or not _DIR.fullmatch(parts[0]) or not _FILE.fullmatch(parts[1]):
            raise CarryRefused(f"a file named {name[:80]!r}, not a cache folder's file")
        d = os.path.join(cache, parts[0])
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(d).st_mode):
                raise CarryRefused(f"{parts[0]} is already there and not a folder") from None
        try:
            fd = os.open(os.path.join(d, parts[1]), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            continue
        with os.fdopen(fd, "wb") as out:
            out.write(data)
        files, wrote = files + 1, wrote + size
    return files, wrote


def carry_in(blobs: list[bytes], folder: str, limit: int) -> tuple[int, str]:
    """`unpack` each blob a process was handed, in its sandbox before the candidate loads: the files written, and a
    note of what was refused (""). A process without a private root takes none (its folder's path is its own)."""
    if folder != FOLDER or not blobs:
        return 0, ""
    files, notes = 0, []
    for blob in blobs:
        try:
            files += unpack(blob, folder, limit)[0]
        except (CarryRefused, OSError) as e:
            notes.append(f"a carried cache was refused: {e}")
    return files, "; ".join(notes)


def carry_out(folder: str, limit: int) -> bytes:
    """`pack`, where the process has a private root and carrying is on (`limit` > 0)."""
    return pack(folder, limit) if limit > 0 and folder == FOLDER else b""


class Kept:
    """The trusted side's blobs, opaque, by the set of sources (their digests) whose process packed them. Safe to
    share between threads."""

    def __init__(self, keep: int = KEEP) -> None:
        self.keep = keep
        self._blobs: OrderedDict[frozenset[str], bytes] = OrderedDict()
        self._lock = threading.Lock()

    def given(self, sources: Iterable[str | None]) -> list[bytes]:
        """Every blob a process running `sources` (None: none, torch's) may unpack: those packed by a process whose
        sources are all among them."""
        mine = frozenset(digest(s) for s in sources if s is not None)
        with self._lock:
            out = [(key, blob) for key, blob in self._blobs.items() if key <= mine]
            for key, _ in out:
                self._blobs.move_to_end(key)
        return [blob for key, blob in sorted(out, key=lambda kb: len(kb[0]))]

    def keep_from(self, sources: Iterable[str | None], blob: bytes) -> None:
        """What a process running `sources` packed (b"": nothing); it replaces what that same set had."""
        key = frozenset(digest(s) for s in sources if s is not None)
        if not key or not blob:
            return
        with self._lock:
            self._blobs[key] = blob
            self._blobs.move_to_end(key)
            while len(self._blobs) > self.keep:
                self._blobs.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._blobs.clear()

    def __len__(self) -> int:
        return len(self._blobs)


KEPT = Kept()          # this process's (a slot's): every evaluation it runs shares them
