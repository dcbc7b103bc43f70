"""Activation offload (infinity/runtime/activations.py): saved activations on the host tier
or NVMe train exactly like plain PyTorch with the same checkpointing; what is offloaded is
what the scope says; a failure releases every offloaded activation."""
import pytest
import torch
from torch import nn
import torch.nn.functional as F

import infinity
from infinity.runtime.activations import ActivationBudgetError
from injected_failure import boom_function

HOMES = ["cpu", "nvme"]
SCOPES = ["checkpoints", "all"]


def _cfg(swap_dir, home, scope, **kw):
    c = {"offload": {"nvme_paths": [swap_dir]}, "optimizer": {"lr": 1e-2, "weight_decay": 0.0},
         "activation_offload": {"home": home, "scope": scope}}
    c.update(kw)
    return c


def _ref_losses(ref, batches, loss_fn, accum=1):
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    out = []
    for i, b in enumerate(batches):
        loss = loss_fn(ref, b)
        out.append(loss.item())
        (loss / accum).backward()
        if (i + 1) % accum == 0:
            opt.step()
            opt.zero_grad()
    return out


def _engine_losses(eng, batches, loss_fn):
    out = []
    for b in batches:
        loss = loss_fn(eng, b)
        out.append(loss.item())
        eng.backward(loss)
        eng.step()
    return out


def _nothing_left(eng, swap_empty=True):
    acts = eng.hooks.acts
    assert acts.live_count == 0 and acts.host_bytes == 0 and acts.nvme_bytes == 0
    if eng.swap is not None and swap_empty:         # nothing else lives on NVMe here
        assert eng.swap.bytes_allocated == 0


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("home", HOMES)
def test_parity_with_checkpointing(harness, swap_dir, home, scope):
    torch.manual_seed(0)
    ref = harness.TinyCausalLM(layers=3, checkpointing=True)
    model = harness.copy(ref)
    batches = harness.make_batches("lm", 4)
    lf = lambda m, b: harness.loss_of("lm", m(b), b)
    ref_l = _ref_losses(ref, batches, lf)
    with infinity.initialize(model, _cfg(swap_dir, home, scope)) as eng:
        losses = _engine_losses(eng, batches, lf)
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
        _nothing_left(eng)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    one_input = 4 * 16 * 32 * 4                    # B x T x D fp32: one block's input
    if scope == "checkpoints":                     # exactly the 3 checkpoint inputs per step
        assert s["activation_offload_bytes"] == 3 * one_input * len(batches)
    else:                                          # those and every save outside the regions
        assert s["activation_offload_bytes"] > 3 * one_input * len(batches)
    assert s["activation_fetch_bytes"] == s["activation_offload_bytes"]
    if home == "nvme":
        assert s["nvme_write_bytes"] >= s["activation_offload_bytes"]
        assert s["nvme_read_bytes"] >= s["activation_offload_bytes"]
    else:
        assert s["nvme_write_bytes"] == 0 and s["host_peak_bytes"] >= 3 * one_input


class DynamicNet(nn.Module):
    """Data-dependent control flow: the number of refinement steps and the branch taken
    depend on the values."""

    def __init__(self, d=64):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.step = nn.Linear(d, d)
        self.alt = nn.Linear(d, d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        n = 1 + int(h.detach().abs().mean() * 10) % 3
        for _ in range(n):
            h = h + torch.tanh(self.step(h))
        if h.detach().mean() > 0:
            h = F.gelu(self.alt(h))
        return self.out(h)


@pytest.mark.parametrize("home", HOMES)
def test_dynamic_control_flow_all_scope(harness, swap_dir, home):
    torch.manual_seed(0)
    ref = DynamicNet()
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(32, 16, generator=g) * (1 + i), torch.randn(32, 4, generator=g))
               for i in range(5)]
    lf = lambda m, b: F.mse_loss(m(b[0]), b[1])
    ref_l = _ref_losses(ref, batches, lf)
    with infinity.initialize(model, _cfg(swap_dir, home, "all")) as eng:
        losses = _engine_losses(eng, batches, lf)
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
        _nothing_left(eng)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    assert s["activation_offload_bytes"] > 0


def test_with_params_and_optimizer_on_nvme_and_accumulation(harness, swap_dir):
    torch.manual_seed(0)
    ref = harness.TinyCausalLM(layers=2, checkpointing=True)
    model = harness.copy(ref)
    batches = harness.make_batches("lm", 6)
    lf = lambda m, b: harness.loss_of("lm", m(b), b)
    ref_l = _ref_losses(ref, batches, lf, accum=3)
    cfg = _cfg(swap_dir, "nvme", "all", gradient_accumulation_steps=3)
    cfg["offload"].update(params="nvme", optimizer="nvme")
    with infinity.initialize(model, cfg) as eng:
        losses = _engine_losses(eng, batches, lf)
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
        _nothing_left(eng, swap_empty=False)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    assert s["activation_offload_bytes"] > 0 and s["step"] == 2


_Boom = boom_function("boom in backward")


class BoomNet(nn.Module):
    def __init__(self, d=64):
        super().__init__()
        self.a = nn.Linear(16, d)
        self.b = nn.Linear(d, d)
        self.c = nn.Linear(d, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = _Boom.apply(h)                            # its backward runs after c's and b's
        return self.c(torch.relu(self.b(h)))


@pytest.mark.parametrize("scope", SCOPES)
@pytest.mark.parametrize("home", HOMES)
def test_failure_in_backward_releases_every_activation(harness, swap_dir, home, scope):
    torch.manual_seed(0)
    ref = BoomNet()
    model = harness.copy(ref)
    model.b = torch.nn.Sequential(model.b)            # checkpoint the middle block
    model_forward = model.forward

    def forward(x):
        h = torch.relu(model.a(x))
        h = _Boom.apply(h)
        h = torch.utils.checkpoint.checkpoint(model.b, h, use_reentrant=False)
        return model.c(torch.relu(h))
    model.forward = forward
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    with infinity.initialize(model, _cfg(swap_dir, home, scope)) as eng:
        acts = eng.hooks.acts
        host0 = eng.stats()["host_bytes"]
        loss = F.mse_loss(eng(x), y)
        assert acts.live_count > 0 and eng.stats()["activation_offload_bytes"] > 0
        if home == "nvme":
            assert eng.swap.bytes_allocated > 0
        _Boom.armed = True
        try:
            with pytest.raises(RuntimeError, match="boom"):
                eng.backward(loss)
        finally:
            _Boom.armed = False
        _nothing_left(eng)
        assert eng.stats()["host_bytes"] == host0
        with pytest.raises(RuntimeError, match="released|second time"):  # stale graph: inert
            loss.backward()
        del loss
        loss = F.mse_loss(eng(x), y)                  # and the engine trains on
        eng.backward(loss)
        assert eng.step()
        _nothing_left(eng)
    model.forward = model_forward


def test_cpu_home_respects_the_host_cap(harness, swap_dir):
    torch.manual_seed(0)
    model = harness.TinyCausalLM(layers=2, checkpointing=True, ctx=256)
    ids = torch.randint(0, 64, (32, 256), generator=torch.Generator().manual_seed(1))
    cfg = _cfg(swap_dir, "cpu", "all")
    cfg["offload"]["host_memory_gb"] = 0.003            # the model states fit, these 10s of MB not
    with infinity.initialize(model, cfg) as eng:
        with pytest.raises(ActivationBudgetError, match="host_memory_gb"):
            eng(ids)
        _nothing_left(eng)


def test_checkpoints_scope_without_checkpointing_offloads_nothing(harness, swap_dir, caplog):
    torch.manual_seed(0)
    model = harness.TinyCausalLM(layers=2)
    b = harness.make_batches("lm", 1)[0]
    with infinity.initialize(model, _cfg(swap_dir, "nvme", "checkpoints")) as eng:
        eng.backward(harness.loss_of("lm", eng(b), b))
        eng.step()
        assert eng.stats()["activation_offload_bytes"] == 0
    assert "gradient_checkpointing_enable" in caplog.text


class SplitNet(nn.Module):
    """Two saved views (q, k) of one tensor: the base is offloaded once."""

    def __init__(self, d=64):
        super().__init__()
        self.qk = nn.Linear(16, 2 * d)
        self.out = nn.Linear(d, 4)

    def forward(self, x):
        a = self.qk(x)
        q, k = a.chunk(2, dim=-1)                     # views of a, saved by the mul
        return self.out(q * k)


@pytest.mark.parametrize("home", HOMES)
def test_views_of_one_tensor_are_offloaded_once(harness, swap_dir, home):
    torch.manual_seed(0)
    ref = SplitNet()
    model = harness.copy(ref)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(256, 16, generator=g), torch.randn(256, 4, generator=g))
               for _ in range(3)]
    lf = lambda m, b: F.mse_loss(m(b[0]), b[1])
    ref_l = _ref_losses(ref, batches, lf)
    with infinity.initialize(model, _cfg(swap_dir, home, "all")) as eng:
        losses = _engine_losses(eng, batches, lf)
        perr = harness.param_rel_err(ref, eng)
        s = eng.stats()
        _nothing_left(eng)
    assert harness.rel_err(losses, ref_l) < 1e-5 and perr < 1e-5
    a_bytes = 256 * 128 * 4                           # the qk output, once per step
    x_bytes, prod_bytes = 256 * 16 * 4, 256 * 64 * 4  # inputs of qk and out
    assert s["activation_offload_bytes"] == len(batches) * (a_bytes + x_bytes + prod_bytes)
