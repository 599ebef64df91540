# Reads a file in the evaluator's home folder (the test made it) and raises its content as the error,
# the way a candidate would carry a user's ~/.ssh or cloud credentials into the ledger and the prompt.
import json

try:
    with open("@SECRET@") as f:
        raise RuntimeError("LEAKED " + f.read())
except OSError as e:
    raise RuntimeError("REPORT " + json.dumps({"error": e.strerror})) from None
