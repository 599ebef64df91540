# Fills /dev/shm and its own folder (at most @LIMIT@ bytes each, well past the configured sizes), and
# leaves the files there, so that a shared /dev/shm or folder would be full for every later candidate.
import json

LIMIT = int("@LIMIT@")
seen = {}
for place in ("/dev/shm", "/kevo", "/tmp"):
    written, error = 0, ""
    try:
        with open(f"{place}/ballast", "wb") as f:
            chunk = b"\xff" * (1 << 20)
            while written < LIMIT:
                f.write(chunk)
                f.flush()
                written += len(chunk)
    except OSError as e:
        error = e.strerror
    seen[place] = {"written": written, "error": error}
raise RuntimeError("REPORT " + json.dumps(seen))
