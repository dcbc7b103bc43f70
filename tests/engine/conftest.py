"""Models and a reference training loop shared by the engine tests (exposed as fixtures)."""
import copy
import math

import pytest
import torch
from torch import nn
import torch.nn.functional as F


class MLPStack(nn.Module):
    """Transformer-style MLP blocks (pre-norm residual)."""

    def __init__(self, d=32, hidden=64, blocks=3, out=8):
        super().__init__()
        self.inp = nn.Linear(16, d)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(d), nn.Linear(d, hidden), nn.GELU(), nn.Linear(hidden, d))
            for _ in range(blocks))
        self.head = nn.Linear(d, out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # k-bias grads are ~0: Adam amplifies noise
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.heads = heads

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        sh = lambda t: t.view(B, T, self.heads, D // self.heads).transpose(1, 2)
        a = F.scaled_dot_product_attention(sh(q), sh(k), sh(v), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, D))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyCausalLM(nn.Module):
    """A small GPT: token + position embeddings, blocks, tied LM head (one group used twice)."""

    def __init__(self, vocab=64, d=32, heads=4, layers=2, ctx=16, checkpointing=False):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.tok.weight
        self.register_buffer("positions", torch.arange(ctx), persistent=False)
        self.checkpointing = checkpointing

    def forward(self, ids):
        T = ids.shape[1]
        x = self.tok(ids) + self.pos(self.positions[:T])
        for b in self.blocks:
            if self.checkpointing and self.training:
                x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False)
            else:
                x = b(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(),
                           ids[:, 1:].reshape(-1))


def make_batches(kind, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    if kind == "mlp":
        return [(torch.randn(8, 16, generator=g), torch.randn(8, 8, generator=g)) for _ in range(n)]
    return [torch.randint(0, 64, (4, 16), generator=g) for _ in range(n)]


def loss_of(kind, model_out, batch):
    if kind == "mlp":
        return F.mse_loss(model_out.float(), batch[1])
    return lm_loss(model_out, batch)


def inputs_of(kind, batch):
    return batch[0] if kind == "mlp" else batch


def reference_run(model, kind, batches, *, lr=1e-2, wd=0.1, accum=2, clip=1.0, sched=None):
    """Plain PyTorch + torch.optim.AdamW: returns per-micro-step losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=wd, betas=(0.9, 0.999),
                            eps=1e-8)
    losses = []
    for i, b in enumerate(batches):
        loss = loss_of(kind, model(inputs_of(kind, b)), b)
        losses.append(loss.item())
        (loss / accum).backward()
        if (i + 1) % accum == 0:
            if clip:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad()
    return losses


def engine_run(engine, kind, batches):
    losses = []
    for b in batches:
        loss = loss_of(kind, engine(inputs_of(kind, b)), b)
        losses.append(loss.item())
        engine.backward(loss)
        engine.step()
    return losses


def rel_err(a, b):
    a = torch.as_tensor(a, dtype=torch.float64)
    b = torch.as_tensor(b, dtype=torch.float64)
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def param_rel_err(ref_model, engine):
    """Norm-relative error over all parameters, read from the engine's homes."""
    sd = engine.state_dict()
    num = den = 0.0
    for name, p in ref_model.named_parameters():
        got = sd[name].double()
        num += float((got - p.detach().double()).pow(2).sum())
        den += float(p.detach().double().pow(2).sum())
    return math.sqrt(num / max(den, 1e-30))


def one_backward_matches(ref, x, cfg, tol=1e-6):
    """One forward/backward of ``ref``'s copy under an engine with ``cfg``: the output,
    the input gradient and every parameter gradient (read from the engine's gradient
    buffers) equal plain PyTorch's on ``ref`` within ``tol``; returns ``engine.stats()``."""
    import infinity
    model = copy.deepcopy(ref)
    x = x.detach().clone().requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    out_ref = ref(x_ref)
    out_ref.square().sum().backward()
    with infinity.initialize(model, cfg) as eng:
        out = eng(x)
        eng.backward(out.square().sum())
        assert rel_err(out.detach(), out_ref.detach()) < tol
        assert rel_err(x.grad, x_ref.grad) < tol
        want_of = dict(ref.named_parameters())
        for g in eng.opt.groups:
            gb = eng.opt.grads.grad_in_hand(g)
            for sl in g.slots:
                got = gb[sl.offset:sl.offset + sl.numel].view(sl.shape)
                assert rel_err(got, want_of[sl.name].grad) < tol, sl.name
        return eng.stats()


@pytest.fixture
def models():
    return {"mlp": MLPStack, "lm": TinyCausalLM}


@pytest.fixture
def harness():
    class H:
        MLPStack = MLPStack
        TinyCausalLM = TinyCausalLM
        make_batches = staticmethod(make_batches)
        reference_run = staticmethod(reference_run)
        engine_run = staticmethod(engine_run)
        rel_err = staticmethod(rel_err)
        param_rel_err = staticmethod(param_rel_err)
        one_backward_matches = staticmethod(one_backward_matches)
        loss_of = staticmethod(loss_of)
        inputs_of = staticmethod(inputs_of)
        copy = staticmethod(copy.deepcopy)
    return H
