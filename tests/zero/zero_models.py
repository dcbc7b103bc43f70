"""Seeded models and data shared by the ZeRO tests and their spawned ranks."""
import torch
from torch import nn


class AwkwardNet(nn.Module):
    """Odd sizes (nothing a multiple of the world size or the alignment), a norm, a
    frozen parameter and a tied weight."""

    def __init__(self, d_in=13, d=37, depth=3, d_out=5):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, 2 * d + 1), nn.GELU(),
                          nn.Linear(2 * d + 1, d)) for _ in range(depth))
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(d, d_out)
        self.shared = nn.Linear(d_out, d_out, bias=False)
        self.shared2 = nn.Linear(d_out, d_out, bias=False)
        self.shared2.weight = self.shared.weight      # tied

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        h = h + 0.1 * self.frozen(h)
        o = self.head(h)
        return self.shared2(self.shared(o)) + o


class StackNet(nn.Module):
    """Linear layers each used once (no tied or frozen weight, odd sizes): every group can
    be stepped as its gradient lands (Note [Streamed gradients])."""

    def __init__(self, d_in=13, d=61, depth=4, d_out=5):
        super().__init__()
        self.inp = nn.Linear(d_in, d)
        self.body = nn.ModuleList(nn.Linear(d, d) for _ in range(depth))
        self.out = nn.Linear(d, d_out)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        for m in self.body:
            h = torch.tanh(m(h))
        return self.out(h)


def make_model(kind="awkward"):
    if kind == "stack":
        return StackNet()
    if kind == "awkward":
        return AwkwardNet()
    if kind == "awkward-mixed":          # a module with a frozen weight and a trainable bias
        m = AwkwardNet()
        m.frozen.bias.requires_grad_(True)
        return m
    raise ValueError(kind)


def make_batches(kind, n, batch, seed=99):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch, 13, generator=g)
        y = torch.randn(batch, 5, generator=g)
        out.append((x, y))
    return out


def unique_param_snapshot(model):
    """``{name: detached clone}`` of the model's parameters, each shared tensor once (under
    the first name that reaches it)."""
    names = {}
    for n, p in model.named_parameters():
        names.setdefault(id(p), (n, p))
    return {n: p.detach().clone() for n, p in names.values()}
