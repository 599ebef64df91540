# Starts a child with CUDA_VISIBLE_DEVICES unset, so CUDA there would enumerate every GPU of the host;
# the child reports which device nodes it sees and can open, and how many GPUs torch finds.
import json
import os
import subprocess
import sys

CHILD = """
import json, os
seen = {"nvidia": sorted(n for n in os.listdir("/dev") if n.startswith("nvidia")), "opened": []}
for n in seen["nvidia"]:
    try:
        os.close(os.open("/dev/" + n, os.O_RDWR)); seen["opened"].append(n)
    except OSError:
        pass
import torch
seen["cuda_devices"] = torch.cuda.device_count()
print(json.dumps(seen))
"""
env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
done = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
seen = {"returncode": done.returncode, "stderr": done.stderr[-500:]}
if done.returncode == 0:
    seen.update(json.loads(done.stdout.strip().splitlines()[-1]))
raise RuntimeError("REPORT " + json.dumps(seen))
