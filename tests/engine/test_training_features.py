"""Issue 5 against plain PyTorch on the same seed and data (fp32, norm-relative < 1e-5):
LR schedules, no-decay groups, frozen base + LoRA, activation checkpointing with NVMe
params, eval/no_grad between steps, buffers."""
import math

import pytest
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from infinity.config import SchedulerConfig
from infinity.optim.schedule import make_lambda


def _nvme(swap_dir, **kw):
    c = {"offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": [swap_dir]},
         "optimizer": {"lr": 1e-2, "weight_decay": 0.0, "no_decay": []}}
    c.update(kw)
    return c


def _train_ref(model, kind, batches, opt, sched=None):
    losses = []
    for b in batches:
        loss = harness_loss(kind, model, b)
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return losses


def harness_loss(kind, model, b):
    if kind == "mlp":
        return F.mse_loss(model(b[0]).float(), b[1])
    logits = model(b)
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           b[:, 1:].reshape(-1))


def test_warmup_cosine_schedule_trajectory_and_params(harness, swap_dir):
    torch.manual_seed(0)
    ref = harness.MLPStack()
    model = harness.copy(ref)
    batches = harness.make_batches("mlp", 8)
    sched_cfg = {"type": "cosine", "warmup_steps": 3, "total_steps": 8, "min_lr": 1e-3}
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    lam = make_lambda(1e-2, SchedulerConfig(**sched_cfg))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lam)
    ref_lrs = []
    losses_ref = []
    for b in batches:
        ref_lrs.append(opt.param_groups[0]["lr"])
        loss = harness_loss("mlp", ref, b)
        losses_ref.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        sched.step()
    lrs, losses = [], []
    with infinity.initialize(model, _nvme(swap_dir, scheduler=sched_cfg)) as eng:
        for b in batches:
            lrs.append(eng.lr)
            loss = harness_loss("mlp", eng, b)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        assert eng.stats()["lr"] == eng.lr
        perr = harness.param_rel_err(ref, eng)
    assert max(abs(a - b) for a, b in zip(lrs, ref_lrs)) < 1e-12
    assert lrs[0] < lrs[2] and lrs[-1] < lrs[3]           # warmup then decay
    assert harness.rel_err(losses, losses_ref) < 1e-5 and perr < 1e-5


def test_lr_scheduler_factory_and_accumulation_boundaries(harness, swap_dir):
    torch.manual_seed(0)
    ref = harness.MLPStack()
    model = harness.copy(ref)
    batches = harness.make_batches("mlp", 8)
    factory = lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    sched = factory(opt)
    for i, b in enumerate(batches):
        (harness_loss("mlp", ref, b) / 2).backward()
        if i % 2 == 1:
            opt.step()
            opt.zero_grad()
            sched.step()
    lrs = []
    cfg = _nvme(swap_dir, gradient_accumulation_steps=2)
    with infinity.initialize(model, cfg, lr_scheduler=factory) as eng:
        for b in batches:
            eng.backward(harness_loss("mlp", eng, b))
            eng.step()
            lrs.append(eng.lr)
        perr = harness.param_rel_err(ref, eng)
    assert lrs == [1e-2, 5e-3, 5e-3, 2.5e-3, 2.5e-3, 1.25e-3, 1.25e-3, 6.25e-4]
    assert perr < 1e-5


def test_no_decay_groups(harness, swap_dir):
    torch.manual_seed(0)
    ref = harness.MLPStack()
    model = harness.copy(ref)
    batches = harness.make_batches("mlp", 6)
    norm_params = {id(p) for m in ref.modules() if isinstance(m, nn.LayerNorm)
                   for p in m.parameters()}
    skip = lambda n, p: n.endswith("bias") or id(p) in norm_params
    decay = [p for n, p in ref.named_parameters() if not skip(n, p)]
    nodecay = [p for n, p in ref.named_parameters() if skip(n, p)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.3},
                             {"params": nodecay, "weight_decay": 0.0}], lr=1e-2)
    _train_ref(ref, "mlp", batches, opt)
    cfg = _nvme(swap_dir)
    cfg["optimizer"] = {"lr": 1e-2, "weight_decay": 0.3, "no_decay": ["bias", "norm"]}
    with infinity.initialize(model, cfg) as eng:
        for b in batches:
            eng.backward(harness_loss("mlp", eng, b))
            eng.step()
        perr = harness.param_rel_err(ref, eng)
    assert perr < 1e-5
    # and it is distinguishable from decaying everything
    torch.manual_seed(0)
    ref2 = harness.MLPStack()
    opt2 = torch.optim.AdamW(ref2.parameters(), lr=1e-2, weight_decay=0.3)
    _train_ref(ref2, "mlp", batches, opt2)
    num = sum(float((a - b).detach().pow(2).sum()) for a, b in zip(ref.parameters(), ref2.parameters()))
    assert math.sqrt(num) > 1e-4


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, r=4):
        super().__init__()
        self.base = base
        self.a = nn.Parameter(torch.randn(r, base.in_features) * 0.1)
        self.b = nn.Parameter(torch.randn(base.out_features, r) * 0.1)

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def _lora_model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(),
                      nn.Linear(64, 8))
    for p in m.parameters():
        p.requires_grad_(False)
    m[0] = LoRALinear(m[0])
    m[2] = LoRALinear(m[2])
    return m


def test_frozen_base_with_lora_adapter(harness, swap_dir):
    ref = _lora_model()
    model = harness.copy(ref)
    batches = harness.make_batches("mlp", 6)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2,
                            weight_decay=0.1)
    losses_ref = _train_ref(ref, "mlp", batches, opt)
    cfg = _nvme(swap_dir)
    cfg["optimizer"] = {"lr": 1e-2, "weight_decay": 0.1, "no_decay": []}
    with infinity.initialize(model, cfg) as eng:
        frozen_before = {n: eng.state_dict()[n].clone() for n, p in model.named_parameters()
                         if not p.requires_grad}
        losses = []
        for b in batches:
            loss = harness_loss("mlp", eng, b)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
        sd = eng.state_dict()
        for n, t in frozen_before.items():
            assert torch.equal(sd[n], t), n          # frozen: never written back
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
    assert harness.rel_err(losses, losses_ref) < 1e-5 and perr < 1e-5
    assert s["nvme_read_bytes"] > 0


@pytest.mark.parametrize("prefetch_depth", [2])
def test_activation_checkpointing_with_nvme_params(harness, swap_dir, prefetch_depth):
    torch.manual_seed(0)
    ref = harness.TinyCausalLM(checkpointing=False)
    model = harness.copy(ref)
    model.checkpointing = True
    batches = harness.make_batches("lm", 6)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    losses_ref = _train_ref(ref, "lm", batches, opt)
    with infinity.initialize(model, _nvme(swap_dir, prefetch={"depth": prefetch_depth})) as eng:
        losses, od = [], []
        for b in batches:
            before = eng.stats()["on_demand_fetches"]
            loss = harness_loss("lm", eng, b)
            losses.append(loss.item())
            eng.backward(loss)
            eng.step()
            od.append(eng.stats()["on_demand_fetches"] - before)
        perr = harness.param_rel_err(ref, eng)
    assert harness.rel_err(losses, losses_ref) < 1e-5 and perr < 1e-5
    assert od[1:] == [0] * (len(od) - 1), od         # prefetch stays ahead of recomputation


def test_eval_and_no_grad_do_not_disturb_training(harness, swap_dir):
    torch.manual_seed(0)
    ref = harness.TinyCausalLM()
    model = harness.copy(ref)
    batches = harness.make_batches("lm", 6)
    probe = harness.make_batches("lm", 1, seed=9)[0]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    ref_evals = []
    for b in batches:
        harness_loss("lm", ref, b).backward()
        opt.step()
        opt.zero_grad()
        ref.eval()
        with torch.no_grad():
            ref_evals.append(ref(probe))
        ref.train()
    with infinity.initialize(model, _nvme(swap_dir)) as eng:
        od = []
        for i, b in enumerate(batches):
            before = eng.stats()["on_demand_fetches"]
            eng.backward(harness_loss("lm", eng, b))
            eng.step()
            od.append(eng.stats()["on_demand_fetches"] - before)
            eng.eval()
            with torch.no_grad():
                out = eng(probe)
            eng.train()
            assert harness.rel_err(out, ref_evals[i]) < 1e-5
        s = eng.stats()
    assert od[1:] == [0] * (len(od) - 1), od
    assert s["untracked_fetches"] > 0 and s["divergent_steps"] == 0


class WithBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 16, bias=False)  # a bias before BN has ~0 grads (Adam noise)
        self.bn = nn.BatchNorm1d(16)
        self.out = nn.Linear(16, 1)
        self.register_buffer("scale", torch.tensor([0.5]))

    def forward(self, x):
        return self.out(F.relu(self.bn(self.fc(x)))) * self.scale


def test_buffers_live_on_device_tier_and_are_saved(harness, swap_dir):
    torch.manual_seed(0)
    ref = WithBuffers()
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(6, 8, generator=g), torch.randn(6, 1, generator=g)) for _ in range(5)]
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    _train_ref(ref, "mlp", data, opt)
    with infinity.initialize(model, _nvme(swap_dir)) as eng:
        for b in data:
            eng.backward(harness_loss("mlp", eng, b))
            eng.step()
        sd = eng.state_dict()
        ref_sd = ref.state_dict()
        assert set(sd) == set(ref_sd)
        for k, v in ref_sd.items():
            got = sd[k]
            if v.is_floating_point():
                assert harness.rel_err(got, v) < 1e-5, k
            else:
                assert torch.equal(got, v), k


def test_curriculum_length_in_stats():
    """engine.set_curriculum_length (the finetune loop and InfinityTrainer call it):
    stats()["curriculum_seqlen"] reports it; None without a curriculum; bad values refused."""
    import torch.nn as nn

    import infinity
    with infinity.initialize(nn.Linear(4, 4), {"offload": {"params": "cpu", "optimizer": "cpu"}}) as e:
        assert e.stats()["curriculum_seqlen"] is None
        e.set_curriculum_length(128)
        assert e.stats()["curriculum_seqlen"] == 128
        for bad in (0, -3, 2.5, True, "64"):
            with pytest.raises(ValueError, match="positive int"):
                e.set_curriculum_length(bad)
        e.set_curriculum_length(None)
        assert e.stats()["curriculum_seqlen"] is None
