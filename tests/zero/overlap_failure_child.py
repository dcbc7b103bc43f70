"""One rank of the "a rank fails mid-overlap" tests (test_overlap_zero.py).

Trains 2 steps with the optimizer step overlapped with backward (ZeRO stage 3), snapshots
its own optimizer shards, then on step 3 the failing rank fails while group steps run
during backward: ``mode: "step"`` makes its overlapped group steps raise on their worker
thread, ``mode: "backward"`` raises inside autograd after the last layers' shards were
reduced (and stepped early on every rank).  Every rank must raise, and no rank's shards
or step count may move; each rank writes its verdict and how many groups it
stepped early in the failing window (the test asserts that the overlap was really on).
In fp32 the master read back is the parameter home shard itself (``external_master``).
"""
import json
import os
import sys
import threading

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from injected_failure import boom_function  # noqa: E402
from zero_harness import attempt_step, child_entry, report_and_exit  # noqa: E402

Boom = boom_function("injected backward failure")
LAYERS = 6


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 64)
        self.body = nn.ModuleList(nn.Linear(64, 64) for _ in range(LAYERS))
        self.out = nn.Linear(64, 4)

    def forward(self, x):
        x = Boom.apply(torch.relu(self.inp(x)))       # raises in backward when armed
        for m in self.body:
            x = torch.relu(m(x))
        return self.out(x)


def main():
    spec = json.loads(open(sys.argv[1]).read())
    rank = int(os.environ["RANK"])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    from dist_child import make_engine       # spill: the NVMe gradient-spill path
    eng = make_engine(Net(), spec["config"], force_spill=spec.get("spill", False))
    if spec.get("spill") and not (eng.zero.spill and eng.placement.stream_window):
        raise AssertionError("the spilled, streamed gradient path was requested but not taken")
    failing = rank == spec["fail_rank"]
    armed = [False]
    store = eng.opt.store
    orig_step = store.step

    def step(items, **kw):          # the overlapped group steps run on "infinity-step"
        if armed[0] and threading.current_thread().name.startswith("infinity-step"):
            raise RuntimeError("injected overlapped step failure")
        return orig_step(items, **kw)
    store.step = step
    g = torch.Generator().manual_seed(1)
    data = [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(3)]
    result = {"rank": rank, "overlap_on": eng.overlap is not None}
    held = []                 # spilled shards kept for an early step (grad_stream.held)
    if eng.opt.grads.grad_stream is not None:
        keep = eng.opt.grads.grad_stream.keep

        def counting_keep(g):
            ok = keep(g)
            held.append(ok)
            return ok
        eng.opt.grads.grad_stream.keep = counting_keep
    for i, (x, y) in enumerate(data):
        xs, ys = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        if i == 2:
            s0 = eng.stats()
            before = s0["optimizer_groups_overlapped"]
            if failing:
                armed[0] = spec["mode"] == "step"
                Boom.armed = spec["mode"] == "backward"
            result.update(attempt_step(eng, xs, ys))
            s1 = eng.stats()
            result["overlapped"] = s1["optimizer_groups_overlapped"] - before
            if spec.get("check_cache"):          # test_shard_cache.py
                result.update(cache_admitted=s0.get("param_cache_admitted", 0),
                              cache_gathers=s0.get("param_cache_gathers", 0),
                              cache_discarded=s1.get("param_cache_evicted", 0)
                              - s0.get("param_cache_evicted", 0),
                              cache_stale=stale_copies(eng))
            result["kept"] = sum(held)
            armed[0] = Boom.armed = False
            break
        eng.backward(nn.functional.mse_loss(eng(xs), ys))
        eng.step()
        held.clear()
    report_and_exit(result, sys.argv[2])


def stale_copies(eng) -> list:
    """Groups whose cached shard copy differs from the master at its NVMe home (read back
    from NVMe): a failed window must leave none (Note [Shard cache])."""
    out = []
    st = eng.opt.store
    for g in eng.opt.groups:
        if eng.mm.cached(g):
            k = eng.opt.key(g)
            t = torch.empty(st.numel(k))
            st.read_master(k, t)
            if not torch.equal(g.host_buf[:t.numel()], t):
                out.append(g.gid)
    return out


if __name__ == "__main__":
    child_entry(main)
