"""One rank of tests/estimate/test_honest_count.py: the engine's own placement plan for a
config (its device, host and NVMe lines), on the simulated device tier."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "estimate"))
from test_device_line_vs_engine import Stack  # noqa: E402
from zero_harness import child_entry, report_and_exit  # noqa: E402


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
