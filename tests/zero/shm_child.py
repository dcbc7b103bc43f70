"""One rank of the shared-memory transport tests (spawned by zero_harness.run_ranks).
Spec (JSON): {"transport", "slot_bytes", "timeout_s", "fail_rank"}.

Every rank builds the same seeded inputs for every rank, so what each collective must
produce is known locally: an all-gather is the concatenation of all shards, a
reduce-scatter this rank's slice of the sum (checked against a float64 sum), an
all-reduce the whole sum.  Sizes cross the slot size (several pieces per collective),
are odd, and the dtypes include bf16 and int8; asynchronous operations are issued
back to back before any is waited for."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry  # noqa: E402


def inputs(rank: int, numel: int, dtype, salt: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-100, 100, (numel,), generator=g, dtype=torch.int64).to(dtype)


def main():
    spec = json.loads(open(sys.argv[1]).read())
    out_path = sys.argv[2]
    torch.set_num_threads(1)
    import logging
    logging.basicConfig(level=logging.INFO)     # the transport's decisions, on stderr
    from infinity.zero import shm_transport
    from infinity.zero.comm import Comm, ensure_process_group
    shm_transport.SLOT_BYTES = int(spec.get("slot_bytes", shm_transport.SLOT_BYTES))
    ensure_process_group(spec.get("timeout_s", 60))
    comm = Comm(timeout_s=spec.get("timeout_s", 60), transport=spec["transport"])
    me, n = comm.rank, comm.world_size
    allocated = False
    if comm.shm is not None:       # sized for the largest collective below (capped by the slot)
        if spec.get("tiny_shm_rank") == me:     # this rank's /dev/shm looks (nearly) full
            import types
            real = shm_transport.os.statvfs
            shm_transport.os.statvfs = lambda p: types.SimpleNamespace(
                f_bavail=16, f_frsize=4096) if p == shm_transport.SHM_ROOT else real(p)
        allocated = comm.shm.allocate(4 * n * 20000, 4 * n * 20000)
    res = {"rank": me, "shm": allocated,
           "leftover": bool(comm.shm is not None and comm.shm.path
                            and os.path.exists(comm.shm.path)),
           "checks": {}}
    if spec.get("fail_rank") == me:   # (before any collective through the slots)
        raise RuntimeError(f"injected failure on rank {me}")
    checks = res["checks"]
    for salt, (numel, dtype) in enumerate([(1001, torch.float32), (4096, torch.bfloat16),
                                           (777, torch.int8), (3, torch.float32),
                                           (20000, torch.float32)]):
        shards = [inputs(r, numel, dtype, salt) for r in range(n)]
        out = torch.empty(n * numel, dtype=dtype)
        comm.all_gather_into(out, shards[me].clone())
        checks[f"all_gather {numel} {dtype}"] = torch.equal(out, torch.cat(shards))
        # in place: the shard is this rank's slice of the output
        out2 = torch.zeros(n * numel, dtype=dtype)
        out2[me * numel:(me + 1) * numel] = shards[me]
        comm.all_gather_into(out2, out2[me * numel:(me + 1) * numel])
        checks[f"all_gather in place {numel} {dtype}"] = torch.equal(out2, torch.cat(shards))
        if not dtype.is_floating_point:
            continue
        fulls = [inputs(r, n * numel, dtype, 50 + salt) for r in range(n)]
        want = torch.stack([f.double() for f in fulls]).sum(0)
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        mine = torch.empty(numel, dtype=dtype)
        comm.reduce_scatter_sum(mine, fulls[me].clone())
        checks[f"reduce_scatter {numel} {dtype}"] = torch.allclose(
            mine.double(), want[me * numel:(me + 1) * numel], rtol=tol, atol=tol)
        t = fulls[me].clone()[: n * numel - 1]          # not a multiple of the world size
        comm.all_reduce_sum(t)
        checks[f"all_reduce {numel} {dtype}"] = torch.allclose(
            t.double(), want[: n * numel - 1], rtol=tol, atol=tol)
    # asynchronous: several in flight on both channels, waited for in reverse
    handles, expect = [], []
    for salt in range(4):
        shards = [inputs(r, 5000 + salt, torch.float32, 90 + salt) for r in range(n)]
        out = torch.empty(n * (5000 + salt))
        handles.append(comm.all_gather_into(out, shards[me], async_op=True))
        expect.append((out, torch.cat(shards)))
        fulls = [inputs(r, n * 300, torch.float32, 70 + salt) for r in range(n)]
        part = torch.empty(300)
        handles.append(comm.reduce_scatter_sum(part, fulls[me], async_op=True))
        expect.append((part, sum(f.double() for f in fulls)[me * 300:(me + 1) * 300].float()))
    for h in reversed(handles):
        h.wait()
    checks["async in flight"] = all(torch.allclose(a.double(), b.double(), atol=1e-5)
                                    for a, b in expect)
    comm.close()
    with open(out_path, "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    child_entry(main)
