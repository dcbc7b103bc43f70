"""The estimator sizes the commit shadows as the engine does (Note [shadow budget]):
every shadow where the NVMe has room beside the rest and the headroom, else what is left
(at least the largest group's); ``offload.commit_shadow_gb`` per rank when set."""
import pytest

from infinity.estimate import estimate
from infinity.estimate.memory_plan import SHADOW_ITEM
from infinity.memory.shadow_budget import nvme_headroom

GB = 10**9
MODEL = dict(params=10**12, layers=128, hidden=25600)


def _machine(nvme_gb):
    return {"gpus": 8, "gpu_mem_gb": 80, "host_mem_gb": 2048, "nvme_gb": nvme_gb,
            "nvme_drives": 8}


def _plan(nvme_gb, **kw):
    est = estimate(machine=_machine(nvme_gb), configs=[("nvme", "nvme")], tiling_max_group_gb=1.31,
                   **kw, **MODEL)
    (cfg,) = est.configs
    items = {it.name: it.nbytes for it in cfg.plan.items if it.tier == "nvme"}
    return cfg, items


def test_room_for_every_shadow_keeps_them_all():
    cfg, items = _plan(60000)
    states = items["optimizer: master + m + v (NVMe)"]
    assert items[SHADOW_ITEM] == states          # one shadow per state tensor


def test_a_smaller_disk_gets_what_is_left_and_fits():
    cfg, full = _plan(60000)
    need_all = sum(full.values())
    have = int(need_all * 0.85)                   # shadows do not fit beside the rest
    cfg, items = _plan(have / GB)
    others = sum(v for k, v in items.items() if k != SHADOW_ITEM)
    assert items[SHADOW_ITEM] < full[SHADOW_ITEM]
    assert items[SHADOW_ITEM] + others <= have - nvme_headroom(have) + 8   # (rounding)
    assert cfg.fits["checkpointing"]


@pytest.mark.parametrize("gb,want", [(100, 800 * GB), (0, None)])
def test_the_setting_is_per_rank(gb, want):
    _, items = _plan(60000, commit_shadow_gb=gb)
    if want is not None:
        assert items[SHADOW_ITEM] == want
    else:       # 0: the least -- the largest group's shadows on every rank
        assert 0 < items[SHADOW_ITEM] < 100 * GB
