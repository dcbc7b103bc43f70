"""One rank of test_nonfinite_result_zero.py: the fp16 model of
tests/engine/test_nonfinite_result.py under ZeRO; only the rank whose shard holds the
overflowing row sees a non-finite Adam result, and the commit vote must roll the update
back on every rank (Note [non-finite result])."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))
import test_nonfinite_result as T  # noqa: E402
from zero_harness import child_entry, report_and_exit, store_snapshot  # noqa: E402


def main():
    spec = json.loads(open(sys.argv[1]).read())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    import infinity
    eng = infinity.initialize(T._model(), spec["config"])
    result = {"rank": rank, "flags": []}
    result["flags"].append(T._step(eng, "quiet"))
    snap = store_snapshot(eng)
    result["flags"].append(T._step(eng, "up"))
    after = store_snapshot(eng)
    result["unchanged"] = all(torch.equal(snap[k], after[k]) for k in snap)
    result["nonfinite_steps"] = eng.stats()["nonfinite_steps"]
    result["flags"].append(T._step(eng, "down"))
    result["state"] = {k: v.float().tolist() for k, v in eng.state_dict().items()}
    eng.close()
    report_and_exit(result, sys.argv[2])


if __name__ == "__main__":
    child_entry(main)
