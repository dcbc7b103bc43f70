"""One rank of test_shadow_budget_zero.py: the model of tests/engine/test_shadow_budget.py
under ZeRO, trained twice -- with every shadow, then with commit_shadow_gb 0 and (on rank
0) a tile write failing after the commit decision of the second update.  The failed rank
finishes the update at its next call (Note [roll forward]); the other rank waits for it in
its next collective; both end with the weights of the run without the failure."""
import contextlib
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))
import test_shadow_budget as T  # noqa: E402
from zero_harness import child_entry, report_and_exit  # noqa: E402


def _run(cfg, rank, fail: bool) -> dict:
    import infinity
    torch.manual_seed(0)
    data = T._batches(4, seed=10 + rank)
    out = {"raised": None}
    with infinity.initialize(T.Net(), cfg) as e:
        for i, (x, y) in enumerate(data):
            arm = T._write_fails_after_decision(e, 2, OSError(5, "simulated EIO after the decision")) \
                if fail and i == 1 else contextlib.nullcontext()
            with arm:
                e.backward(F.mse_loss(e(x).float(), y))
                try:
                    e.step()
                except OSError as err:
                    out["raised"] = str(err)
                    out["pending"] = e.stats()["unfinished_update"]
        st = e.stats()
        out["after_decision"] = st["optimizer_groups_after_decision"]
        out["steps"] = e.global_steps
        out["state"] = {k: v.float().tolist() for k, v in e.state_dict().items()}
    return out


def main():
    spec = json.loads(open(sys.argv[1]).read())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    cfg = spec["config"]
    full = _run(json.loads(json.dumps(cfg)), rank, False)
    cfg["offload"]["commit_shadow_gb"] = 0
    cfg["offload"]["nvme_paths"] = [p + "-budget" for p in cfg["offload"]["nvme_paths"]]
    small = _run(cfg, rank, rank == 0)
    report_and_exit({"rank": rank, "full": full, "small": small}, sys.argv[2])


if __name__ == "__main__":
    child_entry(main)
