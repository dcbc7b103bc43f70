"""The end-to-end benchmark model: a stack of transformer-style MLP blocks.

Pure torch (no infinity imports), so the project venv and the separate DeepSpeed venv
(tools/setup_deepspeed_venv.sh) build bit-identical models and batches from the same seeds.

Each block is ``x + Linear(4h -> h)(GELU(Linear(h -> 4h)(LayerNorm(x))))``; a block has
``(2 * ffn_mult + 3) * h**2``-ish parameters, exactly
``2 * ffn_mult * h * h + ffn_mult * h + h + 2 * h``.

Sizes used by the benchmarks (BASELINE.md's "268.6M" / "67M" MLP stacks, 128 tokens):

    layers=8, hidden=2048  ->  268,550,144 params  (the defaults)
    layers=2, hidden=2048  ->   67,137,536 params

Module names (``<i>.norm``, ``<i>.up``, ``<i>.down``) and the seeding match the model built
by tools/bench_e2e.py, so state dicts are interchangeable.
"""
from __future__ import annotations

import torch
from torch import nn

DEFAULT_LAYERS = 8
DEFAULT_HIDDEN = 2048


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + down(gelu(up(norm(x))))``."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(self.norm(x))))


def count_params(layers: int, hidden: int, ffn_mult: int = 4) -> int:
    """Parameter count of ``build_model(layers, hidden, ffn_mult)`` without building it."""
    ffn = ffn_mult * hidden
    return layers * (2 * hidden * ffn + ffn + hidden + 2 * hidden)


def build_model(layers: int = DEFAULT_LAYERS, hidden: int = DEFAULT_HIDDEN, ffn_mult: int = 4,
                dtype: torch.dtype = torch.float32, seed: int = 0) -> nn.Sequential:
    """A deterministic (``torch.manual_seed(seed)``) stack of ``layers`` MLP blocks."""
    if layers < 1 or hidden < 1 or ffn_mult < 1:
        raise ValueError(f"build_model: layers, hidden and ffn_mult must be >= 1, got "
                         f"layers={layers}, hidden={hidden}, ffn_mult={ffn_mult}")
    torch.manual_seed(seed)
    model = nn.Sequential(*[MLPBlock(hidden, ffn_mult * hidden) for _ in range(layers)])
    if dtype != torch.float32:
        model = model.to(dtype)
    return model


def make_batch(tokens: int, hidden: int, seed: int = 1,
               dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, target)``, both ``[tokens, hidden]`` standard normal, from a private generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    y = torch.randn(tokens, hidden, generator=g)
    return x.to(dtype), y.to(dtype)


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error, computed in fp32 whatever the activations' dtype."""
    return nn.functional.mse_loss(out.float(), target.float())


def proc_io() -> dict | None:
    """This process's storage I/O counters (``/proc/self/io``: read_bytes/write_bytes, ...),
    or None where unavailable. Used by both venvs' runners to cross-check bytes moved."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(":") for line in f)}
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    import sys
    L = int(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_LAYERS
    H = int(sys.argv[2]) if len(sys.argv) > 2 else DEFAULT_HIDDEN
    print(f"layers={L} hidden={H}: {count_params(L, H):,} params")
