"""Budgets: the up-front "working set does not fit" error, peaks within caps, and the
process's peak RSS within the caps plus an allowance measured with torch alone."""
import json
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import infinity
from infinity.memory.plan import WorkingSetError


def _stack(n=4, d=256):
    return nn.Sequential(*[nn.Linear(d, d) for _ in range(n)])


def test_host_cap_below_working_set_fails_up_front(swap_dir):
    cfg = {"offload": {"params": "cpu", "optimizer": "cpu", "nvme_paths": [swap_dir],
                       "host_memory_gb": 0.0005}}
    with pytest.raises(WorkingSetError) as ei:
        infinity.initialize(_stack(), cfg)
    msg = str(ei.value)
    assert "offload.host_memory_gb" in msg and "needs" in msg and 'offload.optimizer to "nvme"' in msg
    assert not os.path.exists(os.path.join(swap_dir, "infinity-rank0"))


def test_device_cap_below_fetch_window_fails_up_front(swap_dir):
    # 10 kB: the tiling limit (10 kB / (depth + 2)) is below one row plus the aligned NVMe
    # range of a tile, so not even tiles fit (0.0001 GB fits with tiling: the test below)
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir],
                       "device_memory_gb": 0.00001}}
    with pytest.raises(WorkingSetError, match="offload.device_memory_gb.*prefetch.depth"):
        infinity.initialize(_stack(), cfg)
    leftovers = [f for _, _, fs in os.walk(swap_dir) for f in fs] if os.path.exists(swap_dir) else []
    assert leftovers == []


def test_device_cap_below_a_group_fits_by_tiling(swap_dir):
    """100 kB of device budget for 263 kB Linear groups: each layer is computed in tiles of
    8 rows (tiling.max_group_gb defaults to 100 kB / (depth + 2)); nothing goes past the
    budget."""
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir],
                       "device_memory_gb": 0.0001}}
    model = _stack()
    with infinity.initialize(model, cfg) as eng:
        assert {s.rows for s in eng.tiling.specs.values()} == {8} and len(eng.tiling.specs) == 4
        x = torch.randn(3, 256)
        eng.backward(eng(x).square().mean())
        eng.step()
        s = eng.stats()
    assert s.get("device_budget_overflows", 0) == 0 and s["tiles_forward"] == 4 * 32


_CHILD = r"""
import json, resource, sys, torch
from torch import nn
import infinity
from infinity.memory.plan import PlacementPlan
mode, swap, host_cap, dev_cap = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
torch.manual_seed(0)
torch.set_num_threads(1)
model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])     # 25M params, 100 MB
x = torch.randn(4, 1024)
out = {}
if mode == "torch":
    with torch.no_grad():
        model(x)
else:
    cfg = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap],
                       "host_memory_gb": host_cap, "device_memory_gb": dev_cap},
           "prefetch": {"depth": 1}}
    if mode == "plan":
        eng = infinity.initialize(model, {**cfg, "offload": {**cfg["offload"],
                                  "host_memory_gb": None, "device_memory_gb": None}})
        out = {"host": eng.placement.host_total, "device": eng.placement.device_total}
        eng.close()
    else:
        with infinity.initialize(model, cfg) as eng:
            for _ in range(2):
                eng.backward(eng(x).square().mean())
                eng.step()
            out = eng.stats()
out["maxrss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print("RESULT " + json.dumps(out))
"""


def _child(*args):
    r = subprocess.run([sys.executable, "-c", _CHILD, *map(str, args)], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    line = [l for l in r.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[7:])


def test_peaks_and_rss_within_caps(tmp_path):
    swap = str(tmp_path / "swap")
    plan = _child("plan", swap, 0, 0)
    host_cap = plan["host"] * 1.05 / 1e9            # just above the working set
    dev_cap = plan["device"] * 1.05 / 1e9
    base = _child("torch", swap, 0, 0)["maxrss"]    # allowance: torch + the model, alone
    s = _child("train", swap, host_cap, dev_cap)
    assert s["step"] == 2
    assert s["host_peak_bytes"] <= host_cap * 1e9
    assert s["device_peak_bytes"] <= dev_cap * 1e9
    assert s["nvme_read_bytes"] > 100e6              # params really were paged from NVMe
    bound = base + (host_cap + dev_cap) * 1e9
    assert s["maxrss"] <= bound, (s["maxrss"], base, host_cap, dev_cap)
    assert not os.path.exists(swap)                  # swap dir (created by us) removed at close
