"""Layer-by-layer knowledge distillation (ZeroQuant's LKD) of a quantized decoder block.

Block ``i`` with 16-bit weights maps the calibration activations ``X_i`` (the 16-bit
model's own, so blocks are independent) to ``Y_i``; the same block with quantized
Linear weights is trained to give ``Y_i`` too (mean squared error, Adam, full
calibration batch each step). The batch comes in chunks (``batches()`` yields
``(X chunk, block kwargs, Y chunk)``, read from :mod:`.calib_pages` when paged): each step
accumulates the gradients of every chunk, each weighted by its share of the elements, so
the step is the full batch's whatever the chunking. Two ways to train, both measured in
docs/benchmarks.md:

- ``"ste"``: the weights are trained through :func:`infinity.quant.fake_quantize`
  (straight-through rounding; each group's scale follows its absmax), then quantized;
- ``"scale"``: the weights stay, the per-group scales are trained (initialised to
  absmax / qmax) and written as learned.

The result per weight is an :class:`infinity.quant.QuantizedTensor`, written as is.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
from torch.func import functional_call

from infinity.quant import fake_quantize, group_scales, quantize

from .errors import CheckpointError

log = logging.getLogger("infinity.checkpoint")

MODES = ("ste", "scale")


@dataclass(frozen=True)
class LKDOptions:
    """Distillation settings, and where the calibration activations live
    (:mod:`.calib_pages`): chunks of about ``chunk_tokens`` tokens (whole sequences, at
    least one), at most ``host_bytes`` of them in host memory, the rest paged to an NVMe
    swap space under ``swap_path`` (None: the export's output directory)."""
    steps: int = 100
    lr: float | None = None         # None: 1e-4 ("ste": weights) / 1e-3 ("scale": relative)
    mode: str = "ste"
    chunk_tokens: int = 4096
    host_bytes: int = 1 << 30
    swap_path: str | None = None

    def __post_init__(self):
        if self.mode not in MODES:
            raise CheckpointError(f"LKD mode must be one of {MODES}, got {self.mode!r}")
        if self.steps < 1:
            raise CheckpointError(f"LKD steps must be >= 1, got {self.steps}")
        if not isinstance(self.chunk_tokens, int) or self.chunk_tokens < 1:
            raise CheckpointError(f"LKD chunk_tokens must be a positive integer, got "
                                  f"{self.chunk_tokens!r}")
        if not isinstance(self.host_bytes, int) or self.host_bytes < 0:
            raise CheckpointError(f"LKD host_bytes must be a non-negative integer, got "
                                  f"{self.host_bytes!r}")


def distil_block(block, batches, weights: dict[str, tuple[int, int]],
                 opts: LKDOptions, *, scale_dtype=torch.float32, name=""):
    """Train ``block``'s quantized weights (``weights``: local name -> (bits, group size))
    to map the calibration chunks (``batches()``: ``(hidden, kwargs, target)`` each) to their
    targets. Returns ({local name: QuantizedTensor} of the best step, first loss, best loss);
    the block's own parameters are left as they were."""
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

    total = _total_elements(batches)
    first = best = None
    snap = {}
    for step in range(opts.steps + 1):
        training = step < opts.steps
        if training:
            optim.zero_grad(set_to_none=True)
        loss_sum = 0.0
        # the quantized weights once per step; each chunk's gradient lands on their detached
        # copies, and one backward through the quantizer follows the last chunk
        with torch.set_grad_enabled(training):
            q = quantized()
        q_leaf = {k: v.detach().requires_grad_(training) for k, v in q.items()}
        for hidden, kwargs, target in batches():
            with torch.set_grad_enabled(training):
                out = functional_call(block, {**frozen, **q_leaf}, (hidden,), kwargs)
                out = out[0] if isinstance(out, (tuple, list)) else out
                loss = torch.nn.functional.mse_loss(out.float(), target.float()) \
                    * (target.numel() / total)
                if training:
                    loss.backward()
            loss_sum += loss.item()
            del out, loss
        if training:
            keys = [k for k in q if q_leaf[k].grad is not None]
            torch.autograd.backward([q[k] for k in keys], [q_leaf[k].grad for k in keys])
        if not math.isfinite(loss_sum):
            raise CheckpointError(f"{name}: LKD loss is {loss_sum} at step {step}; lower "
                                  f"--lkd-lr or use fewer --lkd-steps")
        if first is None:
            first = loss_sum
        if best is None or loss_sum < best:        # keep the best state seen, not the last
            best = loss_sum
            snap = {k: v.detach().clone() for k, v in train.items()}
        if training:
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


def quantized_mse(block, batches, qts) -> float:
    """The block's output error over the calibration chunks with its weights ``qts``
    (local name -> QuantizedTensor)."""
    params = dict(block.named_parameters())
    q = {k: qt.dequantize(params[k].dtype) for k, qt in qts.items()}
    frozen = {k: p.detach() for k, p in params.items() if k not in qts}
    total = _total_elements(batches)
    err = 0.0
    with torch.no_grad():
        for hidden, kwargs, target in batches():
            out = functional_call(block, {**frozen, **q}, (hidden,), kwargs)
            out = out[0] if isinstance(out, (tuple, list)) else out
            err += torch.nn.functional.mse_loss(out.float(), target.float()).item() \
                * (target.numel() / total)
    return err


def _total_elements(batches) -> int:
    n = getattr(batches, "elements", None)
    if n is None:
        n = sum(t.numel() for _h, _k, t in batches())
    if n <= 0:
        raise CheckpointError("LKD: the calibration batch is empty")
    return n


def single_batch(hidden, kwargs, target):
    """``batches`` of one chunk held in memory."""
    def batches():
        yield hidden, kwargs, target
    batches.elements = target.numel()
    return batches


__all__ = ["LKDOptions", "MODES", "distil_block", "quantized_mse", "round_to_nearest",
           "single_batch"]
