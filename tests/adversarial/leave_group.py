# Forks a child that tries to leave the worker's process group (setsid, then setpgid to a group of its own), so a
# stop signal to the worker's group would miss it; the child reports what it got and then keeps running (a busy
# loop), for the test to see whether holding the worker stops it too.
import json
import os

r, w = os.pipe()
if os.fork() == 0:
    seen = {}
    for name, call in (("setsid", os.setsid), ("setpgid", lambda: os.setpgid(0, 0))):
        try:
            call()
            seen[name] = "left"
        except OSError as e:
            seen[name] = e.strerror
    seen["same_group"] = os.getpgrp() == os.getpgid(os.getppid())
    os.write(w, json.dumps(seen).encode())
    while True:
        pass
seen = json.loads(os.read(r, 1 << 12))
raise RuntimeError("REPORT " + json.dumps(seen))
