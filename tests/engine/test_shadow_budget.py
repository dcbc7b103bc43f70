"""All-or-nothing within a shadow budget (Note [shadow budget], Note [roll forward]):
``offload.commit_shadow_gb`` bounds the NVMe the commit shadows take; groups beyond it are
written after the commit decision a batch at a time, and a failure there rolls forward:
the update is finished by the next call (or close()) and training equals torch AdamW."""
import contextlib
import copy
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import infinity
from infinity.config import ConfigError


class Net(nn.Module):
    """Five trainable groups of different sizes."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(16, 48), nn.Linear(48, 48), nn.Linear(48, 64),
                                     nn.Linear(64, 32), nn.Linear(32, 8)])

    def forward(self, x):
        for i, l in enumerate(self.layers):
            x = l(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def _cfg(swap, budget, *, params="nvme", optim="nvme", prec="fp32", clip=0.0, **extra):
    c = {"precision": prec,
         "offload": {"params": params, "optimizer": optim, "nvme_paths": [swap],
                     "commit_shadow_gb": budget},
         "optimizer": {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []},
         "gradient_clipping": clip}
    c.update(extra)
    return c


def _batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]


def _train(e, data):
    for x, y in data:
        e.backward(F.mse_loss(e(x).float(), y))
        e.step()


def _state(e):
    from infinity.engine.checkpoint_state import EngineCheckpoint
    return {n: t.clone() for n, t in EngineCheckpoint(e).checkpoint_tensors()}


def _reference(m, data):
    ref = copy.deepcopy(m)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    for x, y in data:
        F.mse_loss(ref(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {n: p.detach().clone() for n, p in ref.named_parameters()}


def _close(got, want, tol=1e-5):
    num = sum(float((got[n].double() - want[n].double()).pow(2).sum()) for n in want)
    den = sum(float(want[n].double().pow(2).sum()) for n in want)
    return math.sqrt(num / den) < tol


@contextlib.contextmanager
def _write_fails_after_decision(e, nth: int, err: OSError):
    """While the block runs, the ``nth`` tile write after the commit decision raises
    ``err``; the store writes as usual again afterwards."""
    real, calls = e.store._write_tile, [0]

    def failing(*a, **kw):
        calls[0] += e.opt.unfinished is not None      # written after the decision
        if calls[0] == nth:
            raise err
        return real(*a, **kw)
    e.store._write_tile = failing
    try:
        yield
    finally:
        e.store._write_tile = real


def _needs(tmp_path, **kw):
    """Shadow bytes per group key of Net's optimizer on NVMe."""
    torch.manual_seed(0)
    with infinity.initialize(Net(), _cfg(str(tmp_path / "probe"), None, **kw)) as e:
        return {k: e.store.shadow_need(k) for k in e.store.keys()}


@pytest.mark.parametrize("prec,params,clip", [("fp32", "nvme", 0.0), ("fp32", "nvme", 1e-3),
                                              ("bf16", "cpu", 0.0), ("bf16", "nvme", 0.5)])
@pytest.mark.parametrize("share", [1.0, 1 / 3, 0.0])
def test_any_budget_trains_exactly_like_the_full_one(tmp_path, prec, params, clip, share):
    """The same weights and states, bit for bit, whatever the budget; the shadows never
    exceed it (nor the largest group's, the least a budget can be)."""
    needs = _needs(tmp_path, params=params, prec=prec)
    full = sum(needs.values())
    budget = None if share == 1.0 else share * full / 1e9
    data = _batches(4)
    torch.manual_seed(0)
    m = Net()
    ref = copy.deepcopy(m)
    with infinity.initialize(m, _cfg(str(tmp_path / "a"), budget, params=params, prec=prec,
                                     clip=clip)) as e:
        _train(e, data)
        got, st = _state(e), e.stats()
        if share < 1:    # at least the largest group's (plus page slack), else the setting
            assert e.store.shadow_budget <= max(share * full, max(needs.values()) + 3 * 4096)
        assert e.store.shadow_peak <= (full if share == 1 else e.store.shadow_budget)
        assert st["commit_shadow_peak_bytes"] == e.store.shadow_peak
        assert e.global_steps == len(data)
        if share < 1:
            assert st["optimizer_groups_after_decision"] > 0
        if share == 0.0:
            assert st["optimizer_groups_overlapped"] == 0     # 0: no speculative steps
    with infinity.initialize(ref, _cfg(str(tmp_path / "b"), None, params=params, prec=prec,
                                       clip=clip)) as r:
        _train(r, data)
        want = _state(r)
        assert r.stats()["optimizer_groups_after_decision"] == 0
    assert [n for n in want if not torch.equal(got[n], want[n])] == []


def test_the_budget_bounds_the_nvme_reserved_and_held(tmp_path):
    """The swap reserves the homes plus the budget (not one shadow per state tensor), and
    the NVMe allocated beyond the homes stays within it at every allocation."""
    needs = _needs(tmp_path)
    full = sum(needs.values())
    quarter = full // 4
    torch.manual_seed(0)
    with infinity.initialize(Net(), _cfg(str(tmp_path / "q"), quarter / 1e9)) as e:
        from infinity.memory.shadow_budget import SHADOW_LINE
        assert e.placement.nvme[SHADOW_LINE] == max(quarter, e.store.shadow_budget)
        homes = e.swap.bytes_allocated
        seen = []
        real = e.swap.allocate

        def watching(n):
            ext = real(n)
            seen.append(e.swap.bytes_allocated - homes)
            return ext
        e.swap.allocate = watching
        _train(e, _batches(3))
        budget = e.store.shadow_budget
        assert budget == max(quarter, max(needs.values()) + 3 * 4096) or budget >= quarter
        assert seen and max(seen) <= budget + 3 * 4096 * len(needs)   # (page-rounded spans)
        assert e.store.shadow_peak <= budget
    torch.manual_seed(0)
    with infinity.initialize(Net(), _cfg(str(tmp_path / "f"), None)) as e:
        _train(e, _batches(3))
        assert e.store.shadow_peak == full


def test_an_io_error_after_the_decision_rolls_forward(tmp_path):
    """A tile write failing in a group written after the decision: the error is raised,
    the update stays decided (global_steps counts it), the next call finishes it, and the
    trajectory is torch AdamW's."""
    data = _batches(4)
    torch.manual_seed(0)
    m = Net()
    want = _reference(m, data)
    with infinity.initialize(m, _cfg(str(tmp_path / "s"), 0)) as e:
        _train(e, data[:1])
        x, y = data[1]
        with _write_fails_after_decision(e, 2, OSError(5, "simulated EIO after the decision")):
            e.backward(F.mse_loss(e(x).float(), y))
            with pytest.raises(OSError, match="simulated EIO") as ei:
                e.step()
        assert "finishes it" in "".join(getattr(ei.value, "__notes__", []))
        st = e.stats()
        assert st["unfinished_update"] and st["phase"] == "idle" and e.global_steps == 2
        x, y = data[2]
        loss = F.mse_loss(e(x).float(), y)           # the next call finishes the update
        assert not e.stats()["unfinished_update"]
        e.backward(loss)
        e.step()
        _train(e, data[3:])
        assert e.global_steps == 4
        assert _close(e.state_dict(), want)


def test_state_dict_and_close_finish_a_pending_update(tmp_path, caplog):
    data = _batches(3)
    torch.manual_seed(0)
    m = Net()
    want = _reference(m, data[:2])
    with infinity.initialize(m, _cfg(str(tmp_path / "s"), 0)) as e:
        _train(e, data[:1])
        enospc = OSError(28, "simulated ENOSPC after the decision")
        x, y = data[1]
        with _write_fails_after_decision(e, 3, enospc):
            e.backward(F.mse_loss(e(x).float(), y))
            with pytest.raises(OSError):
                e.step()
        assert _close(e.state_dict(), want)          # finished first
        assert not e.stats()["unfinished_update"]
        x, y = data[2]
        with _write_fails_after_decision(e, 3, enospc):
            e.backward(F.mse_loss(e(x).float(), y))
            with pytest.raises(OSError):
                e.step()
        calls = []
        real_finish = e.opt.finish_unfinished

        def spy():
            calls.append(e.opt.unfinished is not None)
            real_finish()
        e.opt.finish_unfinished = spy
        with caplog.at_level(logging.ERROR, logger="infinity"):
            e.close()
        assert calls == [True] and e.opt.unfinished is None
        assert not [r for r in caplog.records if "finishing" in r.getMessage()]


def test_host_states_after_the_decision_take_no_undo_copy(tmp_path, monkeypatch):
    """fp32 with host params and NVMe moments: the master is the host param buffer.
    Groups written after the decision update it in place with no undo copy, and the
    result equals AdamW; a failure part-way through such a group cannot be rolled forward
    (the master is half-updated): FAILED, naming load_checkpoint."""
    from infinity.optim.step_txn import StepTxn
    copies = []
    real_save = StepTxn.save

    def counting(self, view, key=None):
        if self.host_undo:
            copies.append(key)
        return real_save(self, view, key)
    monkeypatch.setattr(StepTxn, "save", counting)
    data = _batches(3)
    torch.manual_seed(0)
    m = Net()
    want = _reference(m, data)
    with infinity.initialize(m, _cfg(str(tmp_path / "s"), 0, params="cpu")) as e:
        _train(e, data)
        after = e.stats()["optimizer_groups_after_decision"]
        assert after > 0
        assert len(copies) <= 3 * (5 - after // 3)     # copies only before the decision
        assert _close(e.state_dict(), want)
    monkeypatch.undo()
    torch.manual_seed(0)
    with infinity.initialize(Net(), _cfg(str(tmp_path / "t"), 0, params="cpu")) as e:
        _train(e, data[:1])
        x, y = data[1]
        with _write_fails_after_decision(e, 2, OSError(5, "simulated EIO")):
            e.backward(F.mse_loss(e(x).float(), y))
            with pytest.raises(OSError) as ei:
                e.step()
        assert "load_checkpoint" in "".join(getattr(ei.value, "__notes__", []))
        assert e.stats()["phase"] == "failed"
        with pytest.raises(RuntimeError, match="load a checkpoint|load_checkpoint"):
            e(x)


def test_commit_shadow_gb_is_validated():
    for bad in (-1, "x", float("nan"), True):
        with pytest.raises(ConfigError, match="commit_shadow_gb"):
            infinity.InfinityConfig.from_dict({"offload": {"commit_shadow_gb": bad}})
    assert infinity.InfinityConfig.from_dict(
        {"offload": {"commit_shadow_gb": 0}}).offload.commit_shadow_gb == 0


def test_the_automatic_budget_follows_the_free_space():
    from infinity.memory.shadow_budget import shadow_budget
    G = 10**9
    # room for everything: all shadows (None)
    assert shadow_budget(None, 12 * G, G, 20 * G, (100 * G, 2 * G)) is None
    # the disk leaves 5 GB beside the homes and headroom: 5 GB
    assert shadow_budget(None, 12 * G, G, 20 * G, (27 * G, 2 * G)) == 5 * G
    # two local ranks share the disk
    assert shadow_budget(None, 12 * G, G, 10 * G, (46 * G, 2 * G), 2) is None
    assert shadow_budget(None, 12 * G, G, 10 * G, (40 * G, 2 * G), 2) == 9 * G
    # nothing left: one group (the rest is the reservation's ENOSPC to report)
    assert shadow_budget(None, 12 * G, G, 20 * G, (10 * G, 2 * G)) == G
    # set: bounded below by one group, above by all
    assert shadow_budget(0, 12 * G, G, 0, None) == G
    assert shadow_budget(3, 12 * G, G, 0, None) == 3 * G
    assert shadow_budget(50, 12 * G, G, 0, None) is None
