"""One rank of tests/estimate/test_honest_count.py: the engine's own placement plan for a
config (its device, host and NVMe lines), on the simulated device tier."""
import json
import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import child_entry, report_and_exit  # noqa: E402


class Stack(nn.Module):
    def __init__(self, d, layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def main():
    spec = json.loads(open(sys.argv[1]).read())
    torch.manual_seed(0)
    import infinity
    with infinity.initialize(Stack(spec["d"], spec["layers"]), spec["config"]) as e:
        pl = e.placement
        out = {"rank": int(os.environ["RANK"]), "device": dict(pl.device), "host": dict(pl.host),
               "separate": bool(pl.separate_device)}
    report_and_exit(out, sys.argv[2])


if __name__ == "__main__":
    child_entry(main)
