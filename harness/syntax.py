"""Parsing Python source into an AST, one parse at a time in this process.

CPython 3.11 and 3.12 raise `SystemError: AST constructor recursion depth mismatch` when two threads
parse at once (python/cpython#106905, fixed in later releases); kevo parses kernel files from several
threads (proposals written while others are judged, parallel judges). Every ast.parse in the project
goes through `parse`. Not covered: compiling or running the code.
"""
from __future__ import annotations

import ast
import threading

_LOCK = threading.Lock()


def parse(source: str, filename: str = "<unknown>") -> ast.Module:
    with _LOCK:
        return ast.parse(source, filename)
