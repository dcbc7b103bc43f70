"""One rank of the "exception in one rank's backward" test (test_rank_failure.py).

Trains 2 steps, snapshots its own optimizer shards, then on step 3 the failing rank's
backward raises inside autograd.  Every rank must raise, and no rank's shards may move:
each rank compares its shards with the snapshot locally and writes the verdict.
"""
import json
import os
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from injected_failure import boom_function  # noqa: E402
from zero_harness import attempt_step, child_entry, report_and_exit  # noqa: E402


Boom = boom_function("injected backward failure")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(16, 32)
        self.b = nn.Linear(32, 32)
        self.c = nn.Linear(32, 4)

    def forward(self, x):
        return self.c(torch.relu(self.b(Boom.apply(torch.relu(self.a(x))))))


def main():
    spec = json.loads(open(sys.argv[1]).read())
    rank, ws = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)
    import infinity
    torch.manual_seed(0)
    eng = infinity.initialize(Net(), spec["config"])
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    result = {"rank": rank}
    for i, (x, y) in enumerate(data):
        xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        if i == 2:
            Boom.armed = rank == spec["fail_rank"]
            t0 = time.monotonic()
            result.update(attempt_step(eng, xs, ys))
            result["seconds"] = time.monotonic() - t0
            Boom.armed = False
            if spec.get("check_after"):
                after(eng, xs, ys, rank, spec, result)
            break
        eng.backward(nn.functional.mse_loss(eng(xs), ys))
        eng.step()
    report_and_exit(result, sys.argv[2])


def after(eng, xs, ys, rank, spec, result):
    """Note [failures in seconds]: every later call refuses naming the failed rank and the
    way out; stats() says so; close() still works.  The failing rank stays alive until the
    other rank has written its verdict (so the other's error came from the store, not from
    this process exiting)."""
    calls = []
    for name, call in (("forward", lambda: eng(xs)), ("step", eng.step),
                       ("backward", lambda: eng.backward(nn.functional.mse_loss(eng(xs), ys)))):
        try:
            call()
            calls.append((name, None))
        except Exception as e:  # noqa: BLE001 - reported to the test
            calls.append((name, f"{type(e).__name__}: {e}"))
    st = eng.stats()
    result.update(calls=calls, phase=st["phase"], failure=st["failure"])
    if rank == spec["fail_rank"]:
        other = os.path.join(os.path.dirname(sys.argv[2]), "rank0.json")
        deadline = time.monotonic() + 90
        while not os.path.exists(other) and time.monotonic() < deadline:
            time.sleep(0.1)
    t0 = time.monotonic()
    eng.close()
    result["closed"] = True
    result["close_seconds"] = time.monotonic() - t0


if __name__ == "__main__":
    child_entry(main)
