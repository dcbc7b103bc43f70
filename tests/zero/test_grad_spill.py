"""The gradient-spill decision rule (parity with spilled shards is in test_stages.py)."""
import infinity.zero.distributed as D
from infinity.config import InfinityConfig


def test_spill_decision():
    class G:
        def __init__(self, n):
            self.padded_numel, self.trainable = n, True
    groups = [G(250_000_000)]                 # 1 GB of fp32 gradients
    nv = InfinityConfig.load({"offload": {"optimizer": "nvme", "params": "nvme",
                                          "host_memory_gb": 1.5}})
    assert D.grad_spill_needed(nv, groups, 1, 3)
    assert D.grad_spill_needed(nv, groups, 1, 2)
    assert not D.grad_spill_needed(nv, groups, 1, 1)      # stage 1 keeps full grads
    assert not D.grad_spill_needed(nv, groups, 2, 3)      # 0.5 GB shard <= 0.75 GB
    big = InfinityConfig.load({"offload": {"optimizer": "nvme", "params": "nvme",
                                           "host_memory_gb": 4}})
    assert not D.grad_spill_needed(big, groups, 1, 3)
    cpu = InfinityConfig.load({"offload": {"optimizer": "cpu", "host_memory_gb": 1.5}})
    assert not D.grad_spill_needed(cpu, groups, 1, 3)
