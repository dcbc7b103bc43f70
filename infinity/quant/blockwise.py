"""One blockwise (group-wise) symmetric integer quantizer.

A tensor ``x`` of shape ``(..., n)`` is cut along its last dimension into groups of
``group_size`` elements (the last group of each row is shorter when ``group_size`` does
not divide ``n``); each group gets one scale ``s = absmax(group) / qmax`` with
``qmax = 2**(bits-1) - 1``, and ``q = clamp(round(x / s), -qmax-1, qmax)`` stored as int8.
``x ~ q * s``. The scale is rounded to ``scale_dtype`` *before* ``q`` is computed, so a
reader that multiplies the stored ``q`` by the stored scale gets exactly what
:func:`dequantize` gives. A group of zeros gets scale 1 (q = 0): no division by zero and
nothing a loader could turn into NaN.

A flat buffer (a ZeRO shard: qwZ) is the ``(1, n)`` case: pass ``x.view(1, -1)``.

Non-finite input is refused (:class:`QuantizationError`, naming the tensor and the first
bad index) rather than silently turned into a NaN scale for a whole group -- unless the
caller asks ``nonfinite="nan"`` (ZeRO++'s collectives, where raising on one rank would
leave its peers waiting in a collective): then a group holding inf or NaN gets a NaN
scale and ``q = 0``, so it dequantizes to NaN as a whole and the non-finite value stays
visible downstream (a NaN loss, a non-finite gradient norm: the step is skipped as
without quantization).

:func:`pack_bits` / :func:`unpack_bits` pack ``bits``-bit integers densely into int32
words along the last dimension, 32/bits per word, element ``j`` of a word at bit
``bits * j``, stored with offset ``2**(bits-1)`` (unsigned): the layout of the
compressed-tensors ``pack-quantized`` format, so the export needs no extra copy.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QuantizationError", "QuantizedTensor", "qrange", "quantize", "dequantize",
           "fake_quantize", "pack_bits", "unpack_bits"]

_BITS = (2, 4, 8)


class QuantizationError(ValueError):
    """Input that cannot be quantized (non-finite values, bad bits/group size)."""


@dataclass
class QuantizedTensor:
    """``q`` (int8, the input's shape), ``scale`` (``(..., ceil(n / group_size))``)."""
    q: torch.Tensor
    scale: torch.Tensor
    bits: int
    group_size: int

    @property
    def shape(self):
        return self.q.shape

    def dequantize(self, dtype=None) -> torch.Tensor:
        return dequantize(self.q, self.scale, self.group_size, dtype=dtype)


def qrange(bits: int) -> tuple[int, int]:
    """(qmin, qmax) of signed ``bits``-bit integers."""
    _check_bits(bits)
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def _check_bits(bits):
    if bits not in _BITS:
        raise QuantizationError(f"bits must be one of {_BITS}, got {bits!r}")


def _check_group(group_size):
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise QuantizationError(f"group_size must be a positive integer, got {group_size!r}")


def _check_finite(x: torch.Tensor, name: str):
    if x.is_floating_point() and x.numel():
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            idx = tuple(int(i) for i in bad.nonzero()[0])
            nbad = int(bad.sum())
            raise QuantizationError(
                f"cannot quantize {name or 'tensor'} {tuple(x.shape)}: {nbad} non-finite "
                f"value(s) (first {x[idx].item()} at index {idx}). Find where they come from "
                f"(a diverged run? a corrupt checkpoint?) before exporting")


def _grouped(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, int]:
    """x (..., n) -> (..., ngroups, group_size) zero-padded, and n."""
    n = x.shape[-1]
    ng = -(-n // group_size) if n else 0
    pad = ng * group_size - n
    if pad:
        x = torch.nn.functional.pad(x, (0, pad))
    return x.reshape(*x.shape[:-1], ng, group_size), n


def group_scales(x: torch.Tensor, bits: int, group_size: int, *,
                 scale_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The per-group scales of ``x`` (``(..., ngroups)``, ``scale_dtype``): absmax / qmax,
    1 for all-zero groups, never below the smallest normal of ``scale_dtype``."""
    _, qmax = qrange(bits)
    g, _ = _grouped(x.float(), group_size)
    amax = g.abs().amax(dim=-1)
    s = _div_qmax(amax, qmax)
    tiny = torch.finfo(scale_dtype).tiny
    s = torch.where(amax == 0, torch.ones_like(s), s.clamp_min(tiny))
    return s.to(scale_dtype)


def _div_qmax(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """``amax / qmax`` correctly rounded on every device: CUDA turns a division by a
    Python number into a product with its reciprocal (off by one ulp from the CPU's and the
    C++ kernel's scales, seen on an H200), a division by a tensor it does not."""
    return amax / torch.full_like(amax, float(qmax))


def quantize(x: torch.Tensor, bits: int, group_size: int, *, scale_dtype=torch.float32,
             scale: torch.Tensor | None = None, name: str = "",
             nonfinite: str = "raise") -> QuantizedTensor:
    """Group-wise symmetric quantization of ``x`` (``(..., n)``; groups along the last dim).
    ``scale``: use these scales instead of absmax ones (learned scales); ``name``: for
    error messages; ``nonfinite``: ``"raise"`` (:class:`QuantizationError`) or ``"nan"``
    (a group holding inf/NaN gets a NaN scale and q = 0: it dequantizes to NaN)."""
    if nonfinite not in ("raise", "nan"):
        raise QuantizationError(f"nonfinite must be 'raise' or 'nan', got {nonfinite!r}")
    _check_bits(bits)
    _check_group(group_size)
    if not x.is_floating_point():
        raise QuantizationError(f"cannot quantize {name or 'tensor'}: dtype {x.dtype} is not "
                                f"floating point")
    if x.dim() == 0:
        x = x.reshape(1)
    if nonfinite == "nan" and scale is None:
        return _quantize_nan(x, bits, group_size, scale_dtype)
    _check_finite(x, name)
    if scale is None:
        scale = group_scales(x, bits, group_size, scale_dtype=scale_dtype)
    else:
        _check_finite(scale, f"the scales of {name or 'tensor'}")
        if bool((scale <= 0).any()):
            raise QuantizationError(f"scales of {name or 'tensor'} must be positive")
    qmin, qmax = qrange(bits)
    g, n = _grouped(x.float(), group_size)
    q = torch.round(g / scale.float().unsqueeze(-1)).clamp_(qmin, qmax).to(torch.int8)
    q = q.reshape(*q.shape[:-2], -1)[..., :n]
    return QuantizedTensor(q.contiguous(), scale, bits, group_size)


def _quantize_nan(x: torch.Tensor, bits: int, group_size: int,
                  scale_dtype: torch.dtype) -> QuantizedTensor:
    """:func:`quantize` with ``nonfinite="nan"``: one pass for the scales, one for q."""
    qmin, qmax = qrange(bits)
    g, n = _grouped(x.float(), group_size)
    amax = g.abs().amax(dim=-1)                  # NaN/inf for a group holding one
    bad = ~torch.isfinite(amax)
    s = _div_qmax(amax, qmax)
    tiny = torch.finfo(scale_dtype).tiny
    s = torch.where(amax == 0, torch.ones_like(s), s.clamp_min(tiny))
    s = s.to(scale_dtype)
    has_bad = bool(bad.any())
    if has_bad:
        s = s.masked_fill(bad, float("nan"))
        div = s.float().masked_fill(bad, 1.0).unsqueeze(-1)
        g = g.masked_fill(bad.unsqueeze(-1), 0.0)
    else:
        div = s.float().unsqueeze(-1)
    q = torch.round(g / div).clamp_(qmin, qmax).to(torch.int8)
    q = q.reshape(*q.shape[:-2], -1)[..., :n]
    return QuantizedTensor(q.contiguous(), s, bits, group_size)


def dequantize(q: torch.Tensor, scale: torch.Tensor, group_size: int, *,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """``q * scale`` group-wise (in fp32, then ``dtype``; default the scale's dtype)."""
    _check_group(group_size)
    g, n = _grouped(q.float(), group_size)
    if g.shape[:-1] != scale.shape:
        raise QuantizationError(f"dequantize: {tuple(q.shape)} in groups of {group_size} needs "
                                f"scales {tuple(g.shape[:-1])}, got {tuple(scale.shape)}")
    x = (g * scale.float().unsqueeze(-1)).reshape(*g.shape[:-2], -1)[..., :n]
    return x.to(dtype or scale.dtype)


class _RoundSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.round(x)

    @staticmethod
    def backward(ctx, g):
        return g


def fake_quantize(x: torch.Tensor, bits: int, group_size: int, *,
                  scale: torch.Tensor | None = None) -> torch.Tensor:
    """Differentiable quantize-dequantize (straight-through rounding): what training
    against the quantized weights sees. ``scale`` (``(..., ngroups)``, may require grad:
    learned scales); default absmax / qmax of ``x`` itself (gradients flow through it)."""
    _check_bits(bits)
    _check_group(group_size)
    qmin, qmax = qrange(bits)
    g, n = _grouped(x, group_size)
    if scale is None:
        amax = g.abs().amax(dim=-1, keepdim=True)
        s = torch.where(amax == 0, torch.ones_like(amax), amax / qmax)
    else:
        s = scale.unsqueeze(-1).to(g.dtype)
    q = torch.clamp(_RoundSTE.apply(g / s), qmin, qmax)
    return (q * s).reshape(*g.shape[:-2], -1)[..., :n]


def pack_bits(q: torch.Tensor, bits: int) -> torch.Tensor:
    """int8 values in ``qrange(bits)`` -> int32 words along the last dim (``ceil(n * bits /
    32)`` per row), offset ``2**(bits-1)``, element j of a word at bit ``bits * j``."""
    _check_bits(bits)
    if q.dtype != torch.int8:
        raise QuantizationError(f"pack_bits: expected int8 values, got {q.dtype}")
    per = 32 // bits
    n = q.shape[-1]
    words = -(-n // per)
    v = q.to(torch.int64) + (1 << (bits - 1))
    pad = words * per - n
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    v = v.reshape(*v.shape[:-1], words, per)
    shifts = torch.arange(per, dtype=torch.int64, device=q.device) * bits
    packed = (v << shifts).sum(dim=-1)
    # the sum fits in 32 unsigned bits; store the same bits as signed int32
    packed = torch.where(packed >= (1 << 31), packed - (1 << 32), packed)
    return packed.to(torch.int32).contiguous()


def unpack_bits(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`: int8 values, ``n`` per row."""
    _check_bits(bits)
    per = 32 // bits
    if packed.shape[-1] * per < n:
        raise QuantizationError(f"unpack_bits: {packed.shape[-1]} words hold at most "
                                f"{packed.shape[-1] * per} {bits}-bit values, asked for {n}")
    v = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64, device=packed.device) * bits
    vals = (v.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    vals = vals.reshape(*packed.shape[:-1], -1)[..., :n]
    return (vals - (1 << (bits - 1))).to(torch.int8)
