"""The estimator's device line against the engine's own placement plan for the same
configuration (one process on the simulated device tier, ``INFINITY_SIMULATE_DEVICE=1``,
the CUDA protocol on CPU): resident parameters, the gradients leaving the device (the
engine's optimizer is CPU Adam for every ``offload.optimizer``, "none" included), and the
optimizer states in host memory."""
import pytest
import torch
from torch import nn

import infinity
from infinity.estimate import Machine, spec_from_module
from infinity.estimate.memory_plan import Knobs, plan_memory


class Stack(nn.Module):
    def __init__(self, d=512, layers=4):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


@pytest.mark.parametrize("optimizer", ["none", "cpu"])
def test_device_and_host_lines_match_the_engine(tmp_path, monkeypatch, optimizer):
    monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    torch.manual_seed(0)
    model = Stack()
    spec = spec_from_module(model, seq=1, hidden=512, heads=1)
    est = plan_memory(spec, Machine(gpus=1, gpu_mem_gb=1, host_mem_gb=64, nvme_gb=10),
                      Knobs(precision="bf16", zero_stage=3), "none", optimizer)
    dev = {i.name: i.nbytes for i in est.items if i.tier == "device"}
    host = {i.name: i.nbytes for i in est.items if i.tier in ("pinned", "pageable")}
    cfg = {"precision": "bf16", "offload": {"params": "none", "optimizer": optimizer,
                                            "nvme_paths": [str(tmp_path)]}}
    with infinity.initialize(model, cfg) as e:
        pl = e.placement
        assert pl.separate_device
        eng_dev, eng_host = dict(pl.device), dict(pl.host)
    # resident parameters: N*lp (the engine pads each group to its alignment)
    assert eng_dev["resident params"] == pytest.approx(dev["params"], rel=0.01)
    # gradients leave the device: the group assembled, one open across backward, the copies
    # in flight (2 x the engine's D2H bound of 2 x the largest group)
    assert eng_dev["gradient D2H sources"] == pytest.approx(dev["grads of groups in backward"],
                                                            rel=0.05)
    assert not any("optimizer" in k for k in dev)          # no optimizer state on the device
    # the optimizer's states (fp32 master + m + v) are host memory for "none" as for "cpu"
    states = next(v for k, v in eng_host.items() if k.startswith("optimizer states"))
    assert states == pytest.approx(host["optimizer: master + m + v (host)"], rel=0.01)
