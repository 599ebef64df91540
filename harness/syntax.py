"""Parsing Python source into an AST, one parse at a time in this process.

CPython 3.11 and 3.12 raise `SystemError: AST constructor recursion depth mismatch` when two threads
parse at once (python/cpython#106905, fixed in later releases); kevo parses kernel files from several
threads (proposals written while others are judged, parallel judges). Every ast.parse in the project
goes through `parse`, which also parses again after that error (another thread outside kevo's lock may
have built an AST meanwhile: seen in a Dask worker of the suite on 3.11.7). Not covered: compiling or
running the code.
"""
from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


_RETRIES = 3


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    """The lock orders kevo's own parses; the counter the error checks is the interpreter's, and other code in
    the process builds ASTs too (Triton reads its kernels' source, a Dask worker's own threads), so a parse that
    met one of those is tried again: the error says the count went wrong, not the source."""
    with _LOCK:
        for _ in range(_RETRIES - 1):
            try:
                return ast.parse(source, filename)
            except SystemError as e:
                if "recursion depth mismatch" not in str(e):
                    raise
        return ast.parse(source, filename)
