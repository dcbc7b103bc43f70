"""CPUAdam as a torch.optim.Optimizer: parity with torch.optim.AdamW/Adam, param groups,
schedulers, state_dict interchange with torch, and clear errors."""
import copy

import pytest
import torch
from torch import nn

from infinity.optim import CPUAdam

TOL = 1e-6


def rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(17, 33), nn.LayerNorm(33), nn.GELU(), nn.Linear(33, 7))


def groups_of(model, lr=1e-2):
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    return [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": lr / 2}]


def train(model, opt, steps, seed=1, sched=None):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 17, generator=gen)
        y = torch.randn(8, 7, generator=gen)
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        losses.append(loss.item())
    return losses


def assert_models_close(a, b, tol=TOL):
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert rel(p, q) < tol, (n, rel(p, q))


@pytest.mark.parametrize("adamw", [True, False])
def test_parity_with_torch_param_groups(adamw):
    ours_m, ref_m = make_model(), make_model()
    ours = CPUAdam(groups_of(ours_m), lr=1e-2, betas=(0.85, 0.995), eps=1e-7, adamw=adamw)
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    ref = ref_cls(groups_of(ref_m), lr=1e-2, betas=(0.85, 0.995), eps=1e-7, foreach=False)
    l1 = train(ours_m, ours, 20)
    l2 = train(ref_m, ref, 20)
    assert_models_close(ours_m, ref_m)
    assert max(abs(a - b) for a, b in zip(l1, l2)) < 1e-5
    # the groups really have different hyperparameters (decay on one, half lr on the other)
    assert ours.param_groups[1]["lr"] == 5e-3 and ours.param_groups[0]["weight_decay"] == 0.1


def test_adamw_and_adam_differ():
    """The decay mode is honoured: AdamW and Adam(L2) trajectories are not the same."""
    a_m, b_m = make_model(), make_model()
    train(a_m, CPUAdam(a_m.parameters(), lr=1e-2, weight_decay=0.1, adamw=True), 5)
    train(b_m, CPUAdam(b_m.parameters(), lr=1e-2, weight_decay=0.1, adamw=False), 5)
    assert rel(a_m[0].weight, b_m[0].weight) > 1e-4


def test_lr_scheduler():
    ours_m, ref_m = make_model(), make_model()
    ours = CPUAdam(ours_m.parameters(), lr=1e-2, weight_decay=0.01)
    ref = torch.optim.AdamW(ref_m.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    lam = lambda s: min(1.0, (s + 1) / 5) * 0.9 ** s  # noqa: E731  warmup then decay
    s1 = torch.optim.lr_scheduler.LambdaLR(ours, lam)
    s2 = torch.optim.lr_scheduler.LambdaLR(ref, lam)
    train(ours_m, ours, 12, sched=s1)
    train(ref_m, ref, 12, sched=s2)
    assert ours.param_groups[0]["lr"] == pytest.approx(1e-2 * lam(12))
    assert_models_close(ours_m, ref_m)


@pytest.mark.parametrize("adamw", [True, False])
def test_state_dict_round_trip_with_torch(adamw):
    ref_cls = torch.optim.AdamW if adamw else torch.optim.Adam
    # 1. ours for 5 steps -> state dict -> torch continues; ours continues too
    a_m = make_model()
    a = CPUAdam(groups_of(a_m), lr=1e-2, adamw=adamw)
    train(a_m, a, 5)
    b_m = copy.deepcopy(a_m)
    b = ref_cls(groups_of(b_m), lr=1e-2, foreach=False)
    b.load_state_dict(copy.deepcopy(a.state_dict()))
    assert b.param_groups[0]["decoupled_weight_decay"] == adamw
    train(a_m, a, 5, seed=2)
    train(b_m, b, 5, seed=2)
    assert_models_close(a_m, b_m)
    # 2. torch's state dict back into a fresh CPUAdam; both continue identically
    c_m = copy.deepcopy(b_m)
    c = CPUAdam(groups_of(c_m), lr=1.0, adamw=not adamw)  # everything comes from the state dict
    c.load_state_dict(copy.deepcopy(b.state_dict()))
    assert c.param_groups[0]["adamw"] == adamw and c.param_groups[1]["lr"] == 5e-3
    assert c.state[next(iter(c_m.parameters()))]["step"].item() == 10
    train(b_m, b, 5, seed=3)
    train(c_m, c, 5, seed=3)
    assert_models_close(c_m, b_m)
    # the check can fail: a fresh optimizer (no state) diverges from the continued one
    d_m = copy.deepcopy(c_m)
    train(d_m, CPUAdam(groups_of(d_m), lr=1e-2, adamw=adamw), 3, seed=4)
    train(c_m, c, 3, seed=4)
    assert max(rel(p, q) for p, q in zip(d_m.parameters(), c_m.parameters())) > 1e-4


def test_state_layout_matches_torch():
    m = make_model()
    opt = CPUAdam(m.parameters())
    train(m, opt, 1)
    st = opt.state_dict()["state"][0]
    assert set(st) == {"step", "exp_avg", "exp_avg_sq"}
    assert st["step"].dtype == torch.float32 and st["step"].ndim == 0 and st["step"].item() == 1
    assert st["exp_avg"].shape == m[0].weight.shape


def test_zero_grad_and_closure():
    m = make_model()
    opt = CPUAdam(m.parameters())
    x = torch.randn(4, 17)

    def closure():
        opt.zero_grad()
        loss = m(x).square().mean()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert isinstance(loss, torch.Tensor)
    opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    before = [p.clone() for p in m.parameters()]
    opt.step()  # no grads: nothing changes
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))


def test_non_contiguous_parameter():
    base = torch.randn(33, 17)
    p = nn.Parameter(base.t())  # non-contiguous view
    q = nn.Parameter(base.t().clone())
    assert not p.is_contiguous()
    ours = CPUAdam([p], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        g = torch.randn(17, 33, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step()
        ref.step()
    assert rel(p, q) < TOL


def test_errors():
    with pytest.raises(ValueError, match="learning rate"):
        CPUAdam([nn.Parameter(torch.zeros(3))], lr=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        CPUAdam([nn.Parameter(torch.zeros(3))], betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="weight_decay"):
        CPUAdam([nn.Parameter(torch.zeros(3))], weight_decay=-0.1)
    with pytest.raises(ValueError, match="meta.*CPU tensors only"):
        CPUAdam([nn.Parameter(torch.zeros(3, device="meta"))])
    with pytest.raises(TypeError, match="float64"):
        CPUAdam([nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    with pytest.raises(ValueError, match="param group 1"):
        CPUAdam([{"params": [nn.Parameter(torch.zeros(3))]},
                 {"params": [nn.Parameter(torch.zeros(3))], "lr": -2.0}])
    p = nn.Parameter(torch.zeros(3))
    opt = CPUAdam([p])
    p.grad = torch.zeros(3).to_sparse()
    with pytest.raises(ValueError, match="sparse"):
        opt.step()
    # a torch state dict with amsgrad is refused at step time, with the reason
    q = nn.Parameter(torch.zeros(3))
    t = torch.optim.AdamW([q], amsgrad=True)
    q.grad = torch.ones(3)
    t.step()
    o = CPUAdam([q])
    o.load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="amsgrad"):
        o.step()
