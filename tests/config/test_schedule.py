"""LR schedules vs transformers' schedulers and vs hand formulas."""
import math

import pytest
import torch
from transformers import (get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup,
                          get_linear_schedule_with_warmup)

from infinity.config import ConfigError, SchedulerConfig
from infinity.optim.schedule import lr_at, lr_trajectory, make_lambda

BASE = 2e-3


def _hf_trajectory(make, n):
    """lr of update k+1 for k in range(n), as produced by an HF LambdaLR stepped per update."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    sched = make(opt)
    out = []
    for _ in range(n):
        out.append(opt.param_groups[0]["lr"])  # the lr this update would use
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("warm,total", [(0, 20), (5, 20), (1, 2), (7, 8), (10, 37)])
def test_linear_matches_transformers(warm, total):
    cfg = SchedulerConfig(type="linear", warmup_steps=warm, total_steps=total)
    hf = _hf_trajectory(lambda o: get_linear_schedule_with_warmup(o, warm, total), total + 5)
    ours = lr_trajectory(total + 5, BASE, cfg)
    assert ours == pytest.approx(hf, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("warm,total", [(0, 20), (5, 20), (1, 2), (10, 37)])
def test_cosine_matches_transformers_up_to_total(warm, total):
    cfg = SchedulerConfig(type="cosine", warmup_steps=warm, total_steps=total)
    hf = _hf_trajectory(lambda o: get_cosine_schedule_with_warmup(o, warm, total), total + 1)
    ours = lr_trajectory(total + 1, BASE, cfg)
    assert ours == pytest.approx(hf, rel=1e-12, abs=1e-15)
    # after total_steps HF's cosine rises again; ours stays at min_lr (documented)
    assert lr_at(total + 3, BASE, cfg) == 0.0


def test_cosine_min_lr_matches_transformers():
    from transformers import get_cosine_with_min_lr_schedule_with_warmup
    warm, total, min_lr = 4, 30, 2e-4
    cfg = SchedulerConfig(type="cosine", warmup_steps=warm, total_steps=total, min_lr=min_lr)
    hf = _hf_trajectory(lambda o: get_cosine_with_min_lr_schedule_with_warmup(
        o, warm, total, min_lr=min_lr), total + 1)
    assert lr_trajectory(total + 1, BASE, cfg) == pytest.approx(hf, rel=1e-12)
    assert lr_at(total, BASE, cfg) == pytest.approx(min_lr)
    assert lr_at(total + 100, BASE, cfg) == pytest.approx(min_lr)


@pytest.mark.parametrize("warm", [0, 1, 6])
def test_constant_matches_transformers(warm):
    cfg = SchedulerConfig(type="constant", warmup_steps=warm)
    hf = _hf_trajectory(lambda o: get_constant_schedule_with_warmup(o, warm), 15)
    assert lr_trajectory(15, BASE, cfg) == pytest.approx(hf, rel=1e-12, abs=1e-15)


def test_hand_formulas():
    # warmup-cosine with a floor, written out by hand
    w, t, m = 10, 110, 1e-4
    cfg = SchedulerConfig(type="cosine", warmup_steps=w, total_steps=t, min_lr=m)
    for s in [0, 1, 5, 9]:
        assert lr_at(s, BASE, cfg) == pytest.approx(BASE * s / w)
    for s in [10, 11, 35, 60, 100, 109, 110]:
        p = (s - w) / (t - w)
        assert lr_at(s, BASE, cfg) == pytest.approx(m + (BASE - m) * 0.5 * (1 + math.cos(math.pi * p)))
    assert lr_at(60, BASE, cfg) == pytest.approx((BASE + m) / 2)  # midpoint of the cosine
    # linear with a floor
    cfg = SchedulerConfig(type="linear", warmup_steps=0, total_steps=4, min_lr=4e-4)
    assert lr_trajectory(6, BASE, cfg) == pytest.approx(
        [BASE, 4e-4 + 0.75 * (BASE - 4e-4), 4e-4 + 0.5 * (BASE - 4e-4),
         4e-4 + 0.25 * (BASE - 4e-4), 4e-4, 4e-4])
    # constant without warmup is flat, with warmup starts from 0
    assert lr_trajectory(3, BASE, SchedulerConfig()) == [BASE] * 3
    assert lr_trajectory(3, BASE, SchedulerConfig(warmup_steps=2)) == [0.0, BASE / 2, BASE]


def test_monotone_decay_and_peak():
    cfg = SchedulerConfig(type="cosine", warmup_steps=5, total_steps=50)
    tr = lr_trajectory(51, BASE, cfg)
    assert max(tr) == pytest.approx(BASE) and tr.index(max(tr)) == 5
    assert all(a >= b for a, b in zip(tr[5:], tr[6:]))


def test_make_lambda_drives_torch_lambdalr():
    cfg = SchedulerConfig(type="cosine", warmup_steps=3, total_steps=12, min_lr=1e-4)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=BASE)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, make_lambda(BASE, cfg))
    seen = []
    for _ in range(15):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx(lr_trajectory(15, BASE, cfg), rel=1e-12, abs=1e-15)
    assert make_lambda(0.0, SchedulerConfig())(3) == 0.0


def test_bad_inputs():
    cfg = SchedulerConfig()
    with pytest.raises(ValueError, match="step must be >= 0"):
        lr_at(-1, BASE, cfg)
    with pytest.raises(TypeError, match="step must be an int"):
        lr_at(1.5, BASE, cfg)
    with pytest.raises(TypeError, match="SchedulerConfig"):
        lr_at(0, BASE, {"type": "constant"})
    with pytest.raises(ConfigError, match="min_lr"):
        lr_at(0, 1e-5, SchedulerConfig(min_lr=1e-3))
    assert lr_at(0, BASE, None) == BASE
