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


def test_spill_without_cap_uses_this_ranks_share_of_ram(monkeypatch):
    """No host cap: the budget is the node's free RAM divided among its ranks."""
    import infinity.memory.plan as plan

    class G:
        def __init__(self, n):
            self.padded_numel, self.trainable = n, True
    monkeypatch.setattr(plan, "mem_available_bytes", lambda: 8_000_000_000)
    nv = InfinityConfig.load({"offload": {"optimizer": "nvme", "params": "nvme"}})
    groups = [G(3_000_000_000)]               # 12 GB fp32 grads; 3 GB shard per rank of 4
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert not D.grad_spill_needed(nv, groups, 4, 3)     # 3 GB <= 8 GB / 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert D.grad_spill_needed(nv, groups, 4, 3)         # 3 GB > 2 GB / 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert D.grad_spill_needed(nv, groups, 4, 3)         # unset: all 4 ranks on this node
