"""Text from outside kevo on its way to a terminal or a commit: `printable` (control characters shown as \\xNN, so a
model's reply, a server's error, a candidate's message or a ledger from elsewhere cannot move the cursor, retitle
the window or write the clipboard of whoever reads it) and `shown` (that, then rich's markup escaped).
Not here: what the text says (the roles, the ledger's messages), where it goes (agent/reading, agent/ledger).
"""
from __future__ import annotations

import re

from rich.markup import escape

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")      # C0 and C1 but tab and newline; ESC among them


def printable(text: str) -> str:
    """`text` with every control character but tab and newline written as \\xNN."""
    return CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def shown(text: str) -> str:
    """`text` for rich to print: printable, its markup escaped."""
    return escape(printable(text))
