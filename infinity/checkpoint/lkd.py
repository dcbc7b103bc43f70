"""Layer-by-layer knowledge distillation (ZeroQuant's LKD) of a quantized decoder block.

Block ``i`` with 16-bit weights maps the calibration activations ``X_i`` (the 16-bit
model's own, so blocks are independent) to ``Y_i``; the same block with quantized
Linear weights is trained to give ``Y_i`` too (mean squared error, Adam, full
calibration batch each step). Two ways to train, both measured in docs/benchmarks.md:

- ``"ste"``: the weights are trained through :func:`infinity.quant.fake_quantize`
  (straight-through rounding; each group's scale follows its absmax), then quantized;
- ``"scale"``: the weights stay, the per-group scales are trained (initialised to
  absmax / qmax) and written as learned.

The result per weight is an :class:`infinity.quant.QuantizedTensor`, written as is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch.func import functional_call

from infinity.quant import fake_quantize, group_scales, quantize

from .errors import CheckpointError

log = logging.getLogger("infinity.checkpoint")

MODES = ("ste", "scale")


@dataclass(frozen=True)
class LKDOptions:
    steps: int = 100
    lr: float | None = None         # None: 1e-4 ("ste": weights) / 1e-3 ("scale": relative)
    mode: str = "ste"

    def __post_init__(self):
        if self.mode not in MODES:
            raise CheckpointError(f"LKD mode must be one of {MODES}, got {self.mode!r}")
        if self.steps < 1:
            raise CheckpointError(f"LKD steps must be >= 1, got {self.steps}")


def distil_block(block, hidden, kwargs, target, weights: dict[str, tuple[int, int]],
                 opts: LKDOptions, *, scale_dtype=torch.float32, name=""):
    """Train ``block``'s quantized weights (``weights``: local name -> (bits, group size))
    to map ``hidden`` to ``target``. Returns ({local name: QuantizedTensor} of the best step,
    first loss, best loss); the block's own parameters are left as they were."""
    params = dict(block.named_parameters())
    for k in weights:
        if k not in params:
            raise CheckpointError(f"{name}: LKD asked for {k!r}, which the block does not have")
    orig = {k: params[k].detach().float() for k in weights}
    if opts.mode == "ste":
        train = {k: w.clone().requires_grad_(True) for k, w in orig.items()}
        lr = opts.lr or 1e-4
    else:
        # log-scales: multiplicative steps, always positive
        train = {k: group_scales(w, b, g).float().log().requires_grad_(True)
                 for k, w in orig.items() for b, g in [weights[k]]}
        lr = opts.lr or 1e-3
    optim = torch.optim.Adam(list(train.values()), lr=lr)
    frozen = {k: p.detach() for k, p in params.items() if k not in weights}
    for p in block.parameters():
        p.requires_grad_(False)

    def quantized():
        out = {}
        for k, (b, g) in weights.items():
            if opts.mode == "ste":
                out[k] = fake_quantize(train[k], b, g).to(params[k].dtype)
            else:
                out[k] = fake_quantize(orig[k], b, g, scale=train[k].exp()).to(params[k].dtype)
        return out

    first = best = None
    snap = {}
    for step in range(opts.steps + 1):
        with torch.set_grad_enabled(step < opts.steps):
            out = functional_call(block, {**frozen, **quantized()}, (hidden,), kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            loss = torch.nn.functional.mse_loss(out.float(), target.float())
        if not torch.isfinite(loss):
            raise CheckpointError(f"{name}: LKD loss is {loss.item()} at step {step}; lower "
                                  f"--lkd-lr or use fewer --lkd-steps")
        if first is None:
            first = loss.item()
        if best is None or loss.item() < best:        # keep the best state seen, not the last
            best = loss.item()
            snap = {k: v.detach().clone() for k, v in train.items()}
        if step < opts.steps:
            optim.zero_grad(set_to_none=True)
            loss.backward()
            optim.step()
    result = {}
    with torch.no_grad():
        for k, (b, g) in weights.items():
            if opts.mode == "ste":
                result[k] = quantize(snap[k], b, g, scale_dtype=scale_dtype, name=f"{name}.{k}")
            else:
                s = snap[k].exp().to(scale_dtype)
                result[k] = quantize(orig[k], b, g, scale=s, name=f"{name}.{k}")
    return result, first, best


def round_to_nearest(block, weights, *, scale_dtype=torch.float32):
    """Plain absmax quantization of the block's ``weights`` (LKD's starting point)."""
    params = dict(block.named_parameters())
    return {k: quantize(params[k].detach().float(), b, g, scale_dtype=scale_dtype)
            for k, (b, g) in weights.items()}


def quantized_mse(block, hidden, kwargs, target, qts) -> float:
    """The block's output error with its weights ``qts`` (local name -> QuantizedTensor)."""
    params = dict(block.named_parameters())
    q = {k: qt.dequantize(params[k].dtype) for k, qt in qts.items()}
    frozen = {k: p.detach() for k, p in params.items() if k not in qts}
    with torch.no_grad():
        out = functional_call(block, {**frozen, **q}, (hidden,), kwargs)
        out = out[0] if isinstance(out, (tuple, list)) else out
        return torch.nn.functional.mse_loss(out.float(), target.float()).item()


__all__ = ["LKDOptions", "MODES", "distil_block", "quantized_mse", "round_to_nearest"]
