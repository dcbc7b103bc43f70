"""NF4 (QLoRA's 4-bit NormalFloat) blockwise quantization and QLoRA's double quantization
of the block scales: the pure-torch reference (any device), which the C++ kernel
(csrc/quant/quant.cpp, through :mod:`infinity.quant.kernel`) reproduces bit for bit.

The numerics are those of bitsandbytes (``bitsandbytes.functional.quantize_4bit(...,
quant_type="nf4")`` and its ``compress_statistics=True``), so a weight quantized here holds
the same codes and scales bitsandbytes would store for it:

* **Code book** (:data:`NF4_CODE`): the 16 sorted NormalFloat values of QLoRA (Dettmers
  et al. 2023, appendix E), -1 .. 1 with an exact 0 at index 7.
* **Blocks**: the tensor is taken flat (``x.reshape(-1)``) and cut into blocks of
  ``block`` elements; the last block may be shorter.  Each block keeps its fp32 absmax
  (0 for an all-zero block: it dequantizes to exact zeros).
* **Rounding**: ``v = clamp(x * (1 / max(absmax, 1e-38)), -1, 1)`` (a reciprocal, then a
  product, in fp32), and the code is the number of midpoints ``(c[i] + c[i+1]) / 2`` that
  lie strictly below ``v``: the nearest code, a tie going to the lower one.
* **Packing**: two codes per byte, element ``2k`` in the high nibble and ``2k + 1`` in the
  low one (bitsandbytes' order), flat over the whole tensor; an odd count leaves code 7
  (0.0) in the last low nibble.  ``ceil(n / 2)`` bytes.
* **Double quantization** (:func:`double_quantize`): the fp32 block scales minus their mean
  (``offset``) are quantized blockwise again, in blocks of 256, to 8-bit codes of
  bitsandbytes' signed dynamic map (:func:`dynamic_code`) with one fp32 absmax per block
  of scales, by the same code-book quantizer as NF4 (reciprocal, clamp, midpoints: the
  numerics of bitsandbytes' pure-torch backend; its CPU library's binary search lands one
  code lower on a few near-midpoint scales).  Dequantized:
  ``scale = code[q] * absmax2 + offset`` (two fp32 roundings).  QLoRA: 0.127 bits per
  weight for the scales instead of 0.5 at block 64.
"""
from __future__ import annotations

import functools

import torch

__all__ = ["NF4_CODE", "DQ_BLOCK", "dynamic_code", "nf4_thresholds", "nf4_quantize_ref",
           "nf4_dequantize_ref", "double_quantize", "double_dequantize", "packed_nbytes"]

#: QLoRA's NormalFloat-4 code book, sorted (index 7 is the exact zero), as bitsandbytes
#: stores it (the same fp32 values).
NF4_CODE = torch.tensor([
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
    -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
    0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
    0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0], dtype=torch.float32)

#: The block size of QLoRA's second-level quantization (of the block scales).
DQ_BLOCK = 256

_ZERO_CODE = 7          # index of 0.0 in NF4_CODE: the pad nibble of an odd count
_TINY = 1e-38           # bitsandbytes' floor of the absmax before the reciprocal


@functools.lru_cache(maxsize=None)
def _on(device: torch.device, which: str) -> torch.Tensor:
    if which == "dthr":
        d = dynamic_code()
        base = (d[:-1] + d[1:]) / 2
    else:
        base = {"code": NF4_CODE, "thr": nf4_thresholds(), "dyn": dynamic_code()}[which]
    return base.to(device)


def nf4_thresholds() -> torch.Tensor:
    """The 15 fp32 midpoints between adjacent NF4 codes (the rounding boundaries)."""
    return (NF4_CODE[:-1] + NF4_CODE[1:]) / 2


@functools.lru_cache(maxsize=None)
def _dynamic_code_cached() -> torch.Tensor:
    # bitsandbytes' create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8):
    # for exponent e = 0..6, 2**e fraction steps: the midpoints of linspace(0.1, 1, 2**e + 1)
    # scaled by 10**(e - 6), both signs; then 0 and 1; sorted.  Built with the same fp32
    # operations (linspace, midpoint, product with the fp32-rounded power of ten).
    vals: list[float] = []
    for e in range(7):
        bounds = torch.linspace(0.1, 1, 2 ** e + 1, dtype=torch.float32)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        vals += ((10 ** (e - 6)) * means).tolist()
        vals += (-(10 ** (e - 6)) * means).tolist()
    vals += [0.0, 1.0]
    vals.sort()
    return torch.tensor(vals, dtype=torch.float32)


def dynamic_code() -> torch.Tensor:
    """bitsandbytes' signed 8-bit dynamic code (256 sorted fp32 values in [-0.993, 1]):
    the code of the double-quantized block scales.  A fresh copy."""
    return _dynamic_code_cached().clone()


def packed_nbytes(n: int) -> int:
    """Bytes holding ``n`` NF4 codes (two per byte)."""
    return (n + 1) // 2


def _blocks(flat: torch.Tensor, block: int) -> torch.Tensor:
    """(n,) -> (ceil(n / block), block), zero-padded."""
    n = flat.numel()
    nb = -(-n // block)
    pad = nb * block - n
    if pad:
        flat = torch.nn.functional.pad(flat, (0, pad))
    return flat.view(nb, block)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15, flat -> ``ceil(n / 2)`` bytes, element 2k high nibble, 2k+1 low
    (code 7 pads an odd count)."""
    c = codes.reshape(-1).to(torch.uint8)
    if c.numel() % 2:
        c = torch.cat([c, c.new_full((1,), _ZERO_CODE)])
    return (c[0::2] << 4) | c[1::2]


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_nibbles`: ``n`` uint8 codes."""
    p = packed.reshape(-1)
    return torch.stack([p >> 4, p & 0xF], dim=-1).reshape(-1)[:n]


def _codebook_quantize(flat: torch.Tensor, block: int, thresholds: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The one blockwise code-book quantizer (bitsandbytes' numerics): ``(codes, absmax)``
    of the fp32 ``flat`` (n,) -- int32 codes (the number of ``thresholds`` strictly below
    ``clamp(x * (1 / max(absmax, 1e-38)), -1, 1)``) and the fp32 absmax per block."""
    n = flat.numel()
    g = _blocks(flat, block)
    absmax = g.abs().amax(dim=-1)
    inv = 1.0 / absmax.clamp(min=_TINY)
    scaled = torch.clamp(g * inv.unsqueeze(-1), -1, 1).reshape(-1)[:n]
    return torch.bucketize(scaled, thresholds, out_int32=True), absmax


def nf4_quantize_ref(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, absmax)`` of ``x`` taken flat: ``ceil(n / 2)`` uint8 bytes and
    ``ceil(n / block)`` fp32 block absmaxes (see the module docstring).  ``x`` must be
    finite (checked by the callers) and ``block`` even."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    if n == 0:
        return (torch.empty(0, dtype=torch.uint8, device=x.device),
                torch.empty(0, dtype=torch.float32, device=x.device))
    codes, absmax = _codebook_quantize(flat, block, _on(flat.device, "thr"))
    return pack_nibbles(codes).contiguous(), absmax.contiguous()


def nf4_dequantize_ref(packed: torch.Tensor, absmax: torch.Tensor, n: int, block: int,
                       dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``n`` values (flat, ``dtype``) of :func:`nf4_quantize_ref`'s output:
    ``code[q] * absmax`` in fp32, then rounded to ``dtype``."""
    if n == 0:
        return torch.empty(0, dtype=dtype, device=packed.device)
    codes = unpack_nibbles(packed, n).long()
    vals = _on(packed.device, "code")[codes]
    g = _blocks(vals, block)
    return (g * absmax.float().unsqueeze(-1)).reshape(-1)[:n].to(dtype)


def double_quantize(absmax: torch.Tensor, block: int = DQ_BLOCK
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """QLoRA's double quantization of fp32 block scales: ``(qscales, absmax2, offset)`` --
    uint8 codes of :func:`dynamic_code` (one per scale), fp32 absmax per ``block`` scales,
    and the fp32 mean that was subtracted first (0-dim).  A block of scales all equal to
    the mean gets absmax2 0 (its scales come back as the mean, exactly)."""
    s = absmax.reshape(-1).float()
    if s.numel() == 0:
        return (torch.empty(0, dtype=torch.uint8, device=s.device),
                torch.empty(0, dtype=torch.float32, device=s.device),
                torch.zeros((), dtype=torch.float32, device=s.device))
    offset = s.mean()
    q, amax2 = _codebook_quantize(s - offset, block, _on(s.device, "dthr"))
    q = q.to(torch.uint8)
    return q.contiguous(), amax2.contiguous(), offset


def double_dequantize(qscales: torch.Tensor, absmax2: torch.Tensor, offset: torch.Tensor,
                      block: int = DQ_BLOCK) -> torch.Tensor:
    """The fp32 block scales of :func:`double_quantize`'s output:
    ``code[q] * absmax2 + offset``."""
    n = qscales.numel()
    if n == 0:
        return torch.empty(0, dtype=torch.float32, device=qscales.device)
    vals = _on(qscales.device, "dyn")[qscales.reshape(-1).long()]
    g = _blocks(vals, block) * absmax2.float().unsqueeze(-1)
    return g.reshape(-1)[:n] + offset.float()
