"""A stand-in for a user's own OpenAI-compatible server, for the tests of `served.external`.

    python tests/served_external.py PORT

It is kevo's embedded server started the way an external one is: it binds the port itself and
takes the candidate's path from $KEVO_CANDIDATE ("" for the baseline). Then it hands the socket
to harness.served.server, which serves the tiny preset on the CPU.
"""
from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from harness.config import load_config  # noqa: E402
from harness.served.launch import embedded_spec  # noqa: E402

sock = socket.socket()
sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sock.bind(("127.0.0.1", int(sys.argv[1])))
sock.listen(128)
sock.set_inheritable(True)
workdir = Path.cwd()                     # the launcher's scratch folder, removed when it stops the server
candidate = os.environ.get("KEVO_CANDIDATE") or None
(workdir / "spec.json").write_text(json.dumps(embedded_spec(load_config(), "cpu", candidate and Path(candidate), workdir)))
os.environ.update(TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
os.execv(sys.executable, [sys.executable, "-m", "harness.served.server", str(sock.fileno()), str(workdir / "spec.json")])
