"""Note [non-finite result] across ranks: rank 0's shard of an fp16 update overflows, rank
1's does not; the commit vote rolls the update back on both (step() False on each,
``nonfinite_steps`` 1, every optimizer state unchanged), and training then matches a
one-process run that never saw that batch."""
import os
import sys

import pytest
import torch

import infinity

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "engine"))
import test_nonfinite_result as T  # noqa: E402
from zero_harness import run_ranks_ok  # noqa: E402


@pytest.mark.parametrize("stage", [2, 3])
def test_one_ranks_overflow_rolls_back_every_rank(tmp_path, stage):
    cfg = T._cfg(tmp_path, "nvme")
    cfg["zero_stage"] = stage
    if stage < 3:
        cfg["offload"]["params"] = "none"      # only stage 3 partitions (offloads) parameters
    res = run_ranks_ok("nonfinite_result_child.py", {"config": cfg}, tmp_path, timeout=180)
    for r in res:
        assert r.result["flags"] == [True, False, True], r
        assert r.result["unchanged"] and r.result["nonfinite_steps"] == 1, r
    # both ranks fed the same batch: the run equals one process's quiet + down
    with infinity.initialize(T._model(), T._cfg(tmp_path, "nvme")) as ref:
        T._step(ref, "quiet")
        T._step(ref, "down")
        want = {k: v.float() for k, v in ref.state_dict().items()}
    for r in res:
        got = r.result["state"]
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            torch.testing.assert_close(torch.tensor(got[k]).view_as(v), v, rtol=0, atol=0, msg=k)
