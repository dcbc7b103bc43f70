"""Quantized weights: the one public entry point of the blockwise quantizer for whole
tensors (the frozen base of QLoRA-style fine-tuning; the same numerics as ZeRO++'s wire
format and bitsandbytes' NF4).

:func:`quantize_weight` takes any floating tensor, flat (``t.reshape(-1)``), in blocks of
``group_size`` elements (the last block may be shorter; padding is internal and never
stored), and returns a :class:`QuantizedWeight`:

* ``"int8"`` / ``"int4"``: symmetric integers, scale ``absmax / qmax`` per block (1 for an
  all-zero block), the numerics of :mod:`infinity.quant.blockwise` / :mod:`~.kernel`;
  int8 one byte per element, int4 packed eight per int32 word
  (:func:`~infinity.quant.blockwise.pack_bits` layout);
* ``"nf4"``: QLoRA's 4-bit NormalFloat code book with fp32 absmax per block, two codes per
  byte in bitsandbytes' nibble order (:mod:`infinity.quant.nf4`): the same bytes and
  scales as ``bitsandbytes.functional.quantize_4bit(t, blocksize=group_size,
  quant_type="nf4")``.

``double_quant=True`` stores the fp32 block scales QLoRA's way: minus their mean, 8-bit
codes of bitsandbytes' dynamic map in blocks of 256 with one fp32 absmax each
(:func:`~infinity.quant.nf4.double_quantize`; for any of the three dtypes).

On CPU (fp32/bf16/fp16) the C++ kernel ``infinity._quant`` does the per-element work;
elsewhere (CUDA) the torch reference does, with the same results.  Inf/NaN are refused
with a :class:`~infinity.quant.blockwise.QuantizationError` that names the tensor.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from infinity.quant.blockwise import QuantizationError, pack_bits, unpack_bits
from infinity.quant.blockwise import dequantize as _int_dequantize
from infinity.quant.blockwise import quantize as _int_quantize
from infinity.quant.kernel import (dequantize_flat, nf4_dequantize_flat, nf4_quantize_flat,
                                   quantize_flat)
from infinity.quant.nf4 import DQ_BLOCK, double_dequantize, double_quantize, packed_nbytes

__all__ = ["QuantizedWeight", "quantize_weight", "WEIGHT_DTYPES", "TORCH_PATH_CHUNK"]

#: The storage formats of :func:`quantize_weight`.
WEIGHT_DTYPES = ("nf4", "int8", "int4")

_BITS = {"int8": 8, "int4": 4}

#: Elements the torch path (off the CPU kernel: CUDA) dequantizes per pass; its
#: temporaries (int64 codes, fp32 values) are bounded by this, not by the weight's size.
TORCH_PATH_CHUNK = 1 << 24


@dataclass(frozen=True, eq=False)
class QuantizedWeight:
    """A tensor stored blockwise-quantized (see the module docstring).

    ``data``: the payload (nf4: uint8, ``ceil(n / 2)``; int8: int8, ``n``; int4: int32,
    ``ceil(n / 8)``).  Block scales: ``scales`` (fp32, one per block) or, with double
    quantization, ``qscales`` (uint8 codes, one per block), ``scales2`` (fp32, one per 256
    blocks) and ``offset`` (fp32, 0-dim).  ``shape`` / ``orig_dtype``: the source tensor's;
    ``name``: for messages."""
    dtype: str
    shape: torch.Size
    group_size: int
    data: torch.Tensor
    scales: torch.Tensor | None
    qscales: torch.Tensor | None = None
    scales2: torch.Tensor | None = None
    offset: torch.Tensor | None = None
    orig_dtype: torch.dtype = torch.float32
    name: str = ""

    @property
    def numel(self) -> int:
        """Elements of the source tensor."""
        return int(torch.Size(self.shape).numel())

    @property
    def nblocks(self) -> int:
        """Blocks of ``group_size`` elements (the last may be shorter)."""
        return -(-self.numel // self.group_size)

    @property
    def double_quant(self) -> bool:
        """Whether the block scales are themselves quantized (QLoRA's double quantization)."""
        return self.qscales is not None

    @property
    def device(self) -> torch.device:
        return self.data.device

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name (payload and scales): what a home keeps."""
        names = ("data", "scales", "qscales", "scales2", "offset")
        return {k: getattr(self, k) for k in names if getattr(self, k) is not None}

    @property
    def nbytes(self) -> int:
        """Bytes stored: payload plus every scale tensor."""
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def bits_per_element(self) -> float:
        """Stored bits per source element, scales included."""
        return 8.0 * self.nbytes / max(self.numel, 1)

    def block_scales(self) -> torch.Tensor:
        """The fp32 scale of every block (dequantized first under double quantization):
        nf4's absmax, int's absmax / qmax."""
        if self.qscales is None:
            return self.scales
        return double_dequantize(self.qscales, self.scales2, self.offset)

    def to(self, device) -> "QuantizedWeight":
        """The same weight with its tensors on ``device``."""
        moved = {k: t.to(device) for k, t in self.tensors().items()}
        return replace(self, **moved)

    def dequantize(self, dtype: torch.dtype | None = None, *,
                   out: torch.Tensor | None = None) -> torch.Tensor:
        """The weight back in ``dtype`` (default: the source's), shaped like the source,
        on the payload's device; written into ``out`` (contiguous, ``numel`` elements,
        its own dtype) when given."""
        n = self.numel
        if out is None:
            out = torch.empty(self.shape, dtype=dtype or self.orig_dtype, device=self.device)
        elif out.numel() != n or not out.is_contiguous() or not out.is_floating_point():
            raise QuantizationError(
                f"dequantize {self.name or 'weight'}: out must be a contiguous floating "
                f"tensor of {n} elements, got {out.dtype} {tuple(out.shape)}"
                f"{'' if out.is_contiguous() else ' (not contiguous)'}")
        scales = self.block_scales().contiguous()
        flat = out.view(-1)
        if self.data.device.type == "cpu" or n <= TORCH_PATH_CHUNK:
            self._dequantize_range(0, n, scales, flat)
            return out
        # the torch path (CUDA) holds several temporaries per element: a pass at a time
        gs = self.group_size
        unit = math.lcm(gs, 8) if self.dtype == "int4" else gs
        step = max(unit, TORCH_PATH_CHUNK // unit * unit)
        for e0 in range(0, n, step):
            e1 = min(n, e0 + step)
            self._dequantize_range(e0, e1, scales, flat[e0:e1])
        return out

    def _dequantize_range(self, e0: int, e1: int, scales: torch.Tensor,
                          dst: torch.Tensor) -> None:
        """Elements ``e0 .. e1`` into ``dst`` (``e0`` a whole number of blocks, and of
        int4 words)."""
        n, gs = e1 - e0, self.group_size
        b0, b1 = e0 // gs, -(-e1 // gs)
        sc = scales[b0:b1]
        if self.dtype == "nf4":
            nf4_dequantize_flat(self.data[e0 // 2:-(-e1 // 2)], sc, n, gs, dst)
            return
        bits = _BITS[self.dtype]
        data = self.data[e0:e1] if bits == 8 else self.data[e0 // 8:-(-e1 // 8)]
        if _int_kernel_ok(bits, gs):
            dequantize_flat(data, sc, n, bits, gs, dst)
        else:
            q = data.view(1, -1) if bits == 8 else unpack_bits(data.view(1, -1), bits, n)
            dst.copy_(_int_dequantize(q, sc.view(1, -1), gs, dtype=torch.float32).view(-1))


def _int_kernel_ok(bits: int, group: int) -> bool:
    return group <= 65536 and not (bits == 4 and group % 8)


def _check_args(t, dtype, group_size, name):
    label = name or "tensor"
    if not isinstance(t, torch.Tensor):
        raise QuantizationError(f"cannot quantize {label}: expected a torch.Tensor, got "
                                f"{type(t).__name__}")
    if not t.is_floating_point():
        raise QuantizationError(f"cannot quantize {label}: dtype {t.dtype} is not floating point")
    if dtype not in WEIGHT_DTYPES:
        raise QuantizationError(f"cannot quantize {label}: dtype must be one of "
                                f"{WEIGHT_DTYPES}, got {dtype!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1 \
            or group_size > 65536:
        raise QuantizationError(f"cannot quantize {label}: group_size must be an integer in "
                                f"[1, 65536], got {group_size!r}")
    if dtype == "nf4" and group_size % 2:
        raise QuantizationError(f"cannot quantize {label} as nf4: group_size must be even (two "
                                f"codes per byte, whole bytes per block), got {group_size}")


def _check_finite(flat: torch.Tensor, shape, name: str) -> None:
    bad = ~torch.isfinite(flat)
    if bool(bad.any()):
        first = int(bad.nonzero()[0, 0])
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(first), tuple(shape))) \
            if len(shape) else ()
        raise QuantizationError(
            f"cannot quantize {name or 'tensor'} {tuple(shape)}: {int(bad.sum())} non-finite "
            f"value(s) (first {flat[first].item()} at index {idx}); a quantized weight "
            f"cannot hold inf or NaN -- find where they come from (a diverged run? a corrupt "
            f"checkpoint?)")


def quantize_weight(t: torch.Tensor, dtype: str = "nf4", group_size: int = 64, *,
                    double_quant: bool = False, name: str = "") -> QuantizedWeight:
    """Quantize ``t`` (any shape, any floating dtype, CPU or CUDA) blockwise, flat, in
    blocks of ``group_size`` elements, to ``dtype`` (``"nf4"``, ``"int8"`` or ``"int4"``);
    ``double_quant``: quantize the block scales too (QLoRA); ``name``: the tensor's name in
    error messages.  Raises :class:`QuantizationError` for inf/NaN and bad arguments.
    The tensors of the result live on ``t``'s device."""
    _check_args(t, dtype, group_size, name)
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    n = flat.numel()
    # inf/NaN: the kernels give such a block a non-finite scale, so the scan for the first
    # bad value (a pass over the weight) runs only when a scale says there is one
    if dtype == "nf4":
        data, scales = nf4_quantize_flat(flat, group_size)
    else:
        bits = _BITS[dtype]
        if _int_kernel_ok(bits, group_size):
            data, scales = quantize_flat(flat, bits, group_size)
        else:
            _check_finite(flat, t.shape, name)
            qt = _int_quantize(flat.view(1, -1), bits, group_size, name=name)
            data = qt.q.reshape(-1) if bits == 8 else pack_bits(qt.q, bits).reshape(-1)
            scales = qt.scale.reshape(-1).float()
    if n and not bool(torch.isfinite(scales).all()):
        _check_finite(flat, t.shape, name)
    expected = packed_nbytes(n) if dtype == "nf4" else (n if dtype == "int8" else -(-n // 8))
    if data.numel() != expected:             # an internal invariant, not user input
        raise QuantizationError(f"quantize {name or 'tensor'}: payload of {data.numel()} "
                                f"elements, expected {expected}")
    qw = QuantizedWeight(dtype=dtype, shape=torch.Size(t.shape), group_size=group_size,
                         data=data.contiguous(), scales=scales.contiguous(),
                         orig_dtype=t.dtype, name=name)
    if double_quant:
        qs, s2, off = double_quantize(scales, DQ_BLOCK)
        qw = replace(qw, scales=None, qscales=qs, scales2=s2, offset=off)
    return qw
