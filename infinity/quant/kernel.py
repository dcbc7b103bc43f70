"""The fast path of :mod:`infinity.quant.blockwise` for flat buffers (ZeRO++'s wire format).

:func:`quantize_flat` / :func:`dequantize_flat` give exactly what
``blockwise.quantize(x.view(1, -1), bits, block, nonfinite="nan")`` (+ ``pack_bits`` for
4 bits) and ``blockwise.dequantize`` give -- same scales, same integers, same packing --
but in one pass per block: on CPU through the C++ kernel ``infinity._quant``
(csrc/quant/quant.cpp, built by ``scripts/setup.sh``), elsewhere (CUDA) through the torch
ops of :mod:`~infinity.quant.blockwise`.  ``tools/bench_zeropp.py --quant`` measures both
against a copy of the same bytes (docs/benchmarks.md).

Payload: ``bits`` 8 -> int8, one per element; ``bits`` 4 -> int32 words, 8 elements each
(:func:`~infinity.quant.blockwise.pack_bits` layout).  Scales: fp32, one per ``block``
elements (the last block may be shorter).  Non-finite input: the block's scale is NaN
and it dequantizes to NaN (never raised: these run inside collectives).
"""
from __future__ import annotations

import threading

import torch

from infinity.quant.blockwise import QuantizationError, dequantize, pack_bits, quantize, unpack_bits

__all__ = ["quantize_flat", "dequantize_flat", "payload_numel", "native"]

_ext = None
_lock = threading.Lock()
_CODES = {torch.float32: 0, torch.bfloat16: 1}


def _kernel():
    global _ext
    if _ext is None:
        with _lock:
            if _ext is None:
                try:
                    from infinity import _quant as ext
                except ImportError as e:
                    raise ImportError(
                        f"infinity._quant is not built ({e}); build it with "
                        f"`INFINITY_BUILD_ONLY=_quant python setup.py build_ext --inplace` or "
                        f"`bash scripts/setup.sh`") from e
                _ext = ext
    return _ext


def native(x: torch.Tensor) -> bool:
    """Whether ``x`` goes through the C++ kernel (CPU, fp32/bf16, contiguous)."""
    return x.device.type == "cpu" and x.dtype in _CODES and x.is_contiguous()


def payload_numel(n: int, bits: int) -> int:
    return n if bits == 8 else -(-n // 8)


def _check(bits: int, block: int) -> None:
    if bits not in (8, 4):
        raise QuantizationError(f"quantize_flat: bits must be 8 or 4, got {bits!r}")
    if not isinstance(block, int) or block < 1 or block > 65536 or (bits == 4 and block % 8):
        raise QuantizationError(f"quantize_flat: block must be in [1, 65536] (a multiple of 8 "
                                f"for int4), got {block!r}")


def quantize_flat(x: torch.Tensor, bits: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(payload, scales)`` of the flat tensor ``x`` (any shape: taken as ``x.reshape(-1)``)."""
    _check(bits, block)
    flat = x.reshape(-1)
    n = flat.numel()
    nb = -(-n // block)
    if not native(flat):
        qt = quantize(flat.view(1, -1), bits, block, nonfinite="nan")
        q = qt.q.reshape(-1) if bits == 8 else pack_bits(qt.q, bits).reshape(-1)
        return q, qt.scale.reshape(-1)
    ext = _kernel()
    out = torch.empty(payload_numel(n, bits), dtype=torch.int8 if bits == 8 else torch.int32)
    scales = torch.empty(nb, dtype=torch.float32)
    ext.quantize(flat.data_ptr(), _CODES[flat.dtype], n, block, bits, out.data_ptr(),
                 scales.data_ptr())
    return out, scales


def dequantize_flat(payload: torch.Tensor, scales: torch.Tensor, n: int, bits: int, block: int,
                    out: torch.Tensor) -> torch.Tensor:
    """Write the ``n`` dequantized values into ``out`` (flat, fp32 or bf16) and return it."""
    _check(bits, block)
    want = (torch.int8 if bits == 8 else torch.int32, payload_numel(n, bits))
    if (payload.dtype, payload.numel()) != want or scales.numel() != -(-n // block) \
            or out.numel() != n:
        raise QuantizationError(
            f"dequantize_flat: {n} elements of {bits} bits in blocks of {block} need a "
            f"{want[0]} payload of {want[1]}, {-(-n // block)} scales and an output of {n}; "
            f"got {payload.dtype} x {payload.numel()}, {scales.numel()}, {out.numel()}")
    if not out.is_contiguous():
        raise QuantizationError("dequantize_flat: the output must be contiguous")
    flat = out.view(-1)
    if not (native(flat) and payload.device.type == "cpu" and payload.is_contiguous()
            and scales.dtype == torch.float32 and scales.is_contiguous()):
        q = payload.view(1, -1) if bits == 8 else unpack_bits(payload.view(1, -1), bits, n)
        flat.copy_(dequantize(q, scales.view(1, -1), block, dtype=torch.float32).view(-1))
        return out
    _kernel().dequantize(payload.data_ptr(), n, block, bits, scales.data_ptr(),
                         flat.data_ptr(), _CODES[flat.dtype])
    return out
