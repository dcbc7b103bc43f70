"""The fast path of :mod:`infinity.quant.blockwise` for flat buffers (ZeRO++'s wire format).

:func:`quantize_flat` / :func:`dequantize_flat` give exactly what
``blockwise.quantize(x.view(1, -1), bits, block, nonfinite="nan")`` (+ ``pack_bits`` for
4 bits) and ``blockwise.dequantize`` give -- same scales, same integers, same packing --
but in one pass per block: on CPU through the C++ kernel ``infinity._quant``
(csrc/quant/quant.cpp, built by ``scripts/setup.sh``), elsewhere (CUDA) through the torch
ops of :mod:`~infinity.quant.blockwise`.  ``tools/bench_zeropp.py --quant`` measures both
against a copy of the same bytes (docs/benchmarks.md).

:func:`nf4_quantize_flat` / :func:`nf4_dequantize_flat` do the same for NF4 (QLoRA's 4-bit
NormalFloat, :mod:`infinity.quant.nf4`): the C++ kernel on CPU (fp32/bf16, contiguous;
fp16 goes through fp32), the torch reference of :mod:`~infinity.quant.nf4` elsewhere --
the same bytes and scales either way.

Payload: ``bits`` 8 -> int8, one per element; ``bits`` 4 -> int32 words, 8 elements each
(:func:`~infinity.quant.blockwise.pack_bits` layout).  Scales: fp32, one per ``block``
elements (the last block may be shorter).  Non-finite input: the block's scale is NaN
and it dequantizes to NaN (never raised: these run inside collectives).
"""
from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from infinity.quant.blockwise import QuantizationError, dequantize, pack_bits, quantize, unpack_bits

from infinity.quant.nf4 import nf4_dequantize_ref, nf4_quantize_ref, packed_nbytes

__all__ = ["quantize_flat", "dequantize_flat", "payload_numel", "native", "nf4_quantize_flat",
           "nf4_dequantize_flat"]

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


#: Elements below which a kernel call runs on the calling thread alone.
PARALLEL_MIN = 1 << 22
_pool: ThreadPoolExecutor | None = None
_pool_size = 0


def _forget_pool() -> None:
    """In a forked child: the parent's worker threads do not exist there."""
    global _pool, _pool_size
    _pool, _pool_size = None, 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)


def _parallel(n: int, unit: int, fn) -> None:
    """``fn(e0, e1)`` over ``[0, n)`` split into ranges of whole ``unit``s, on up to
    ``torch.get_num_threads()`` threads (the kernels release the GIL; blocks are
    independent, so the bytes are those of one call)."""
    k = min(torch.get_num_threads(), n // (PARALLEL_MIN // 2))
    if k <= 1:
        fn(0, n)
        return
    global _pool, _pool_size
    with _lock:
        if _pool is None or _pool_size < k:
            old, _pool, _pool_size = _pool, ThreadPoolExecutor(
                k, thread_name_prefix="infinity-quant"), k
            if old is not None:
                old.shutdown(wait=False)
        pool = _pool
    step = -(-n // k // unit) * unit
    futs = [pool.submit(fn, e0, min(n, e0 + step)) for e0 in range(step, n, step)]
    err = None
    try:
        fn(0, min(n, step))
    except BaseException as e:  # noqa: BLE001 - raised below, after every range finished
        err = e
    for f in futs:
        try:
            f.result()
        except BaseException as e:  # noqa: BLE001 - the first error is the one raised
            err = err or e
    if err is not None:
        raise err


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
    src, code, isz = flat.data_ptr(), _CODES[flat.dtype], flat.element_size()
    per = 1 if bits == 8 else 0.5                 # payload bytes per element

    def run(e0, e1):
        ext.quantize(src + e0 * isz, code, e1 - e0, block, bits, out.data_ptr() + int(e0 * per),
                     scales.data_ptr() + 4 * (e0 // block))
    _parallel(n, block if bits == 8 else math.lcm(block, 8), run)
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
    ext, code, isz = _kernel(), _CODES[flat.dtype], flat.element_size()
    per = 1 if bits == 8 else 0.5

    def run(e0, e1):
        ext.dequantize(payload.data_ptr() + int(e0 * per), e1 - e0, block, bits,
                       scales.data_ptr() + 4 * (e0 // block), flat.data_ptr() + e0 * isz, code)
    _parallel(n, block if bits == 8 else math.lcm(block, 8), run)
    return out


def _nf4_kernel():
    ext = _kernel()
    if not hasattr(ext, "nf4_quantize"):
        raise ImportError(
            "infinity._quant was built before NF4 was added; rebuild it with "
            "`INFINITY_BUILD_ONLY=_quant python setup.py build_ext --inplace` or "
            "`bash scripts/setup.sh`")
    return ext


def _check_nf4_block(block: int) -> None:
    if not isinstance(block, int) or isinstance(block, bool) or block < 2 or block > 65536 \
            or block % 2:
        raise QuantizationError(f"nf4: the block size must be an even integer in [2, 65536] "
                                f"(two codes per byte, whole bytes per block), got {block!r}")


def nf4_quantize_flat(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed, absmax)`` of ``x`` taken flat: ``ceil(n / 2)`` uint8 bytes (two NF4 codes
    each, bitsandbytes' nibble order) and ``ceil(n / block)`` fp32 block absmaxes.  ``x``
    must be finite (a block holding inf/NaN gets a NaN absmax: it dequantizes to NaN)."""
    _check_nf4_block(block)
    flat = x.reshape(-1)
    if flat.device.type == "cpu" and flat.dtype == torch.float16:
        flat = flat.float()
    if not native(flat):
        return nf4_quantize_ref(flat, block)
    n = flat.numel()
    out = torch.empty(packed_nbytes(n), dtype=torch.uint8)
    absmax = torch.empty(-(-n // block), dtype=torch.float32)
    ext, code, isz = _nf4_kernel(), _CODES[flat.dtype], flat.element_size()

    def run(e0, e1):
        ext.nf4_quantize(flat.data_ptr() + e0 * isz, code, e1 - e0, block,
                         out.data_ptr() + e0 // 2, absmax.data_ptr() + 4 * (e0 // block))
    _parallel(n, block, run)
    return out, absmax


def nf4_dequantize_flat(packed: torch.Tensor, absmax: torch.Tensor, n: int, block: int,
                        out: torch.Tensor) -> torch.Tensor:
    """Write the ``n`` values of :func:`nf4_quantize_flat`'s ``(packed, absmax)`` into
    ``out`` (``n`` elements, contiguous, any float dtype) and return it."""
    _check_nf4_block(block)
    if packed.dtype != torch.uint8 or packed.numel() != packed_nbytes(n) \
            or absmax.numel() != -(-n // block) or out.numel() != n:
        raise QuantizationError(
            f"nf4_dequantize_flat: {n} elements in blocks of {block} need {packed_nbytes(n)} "
            f"uint8 bytes, {-(-n // block)} scales and an output of {n}; got {packed.dtype} x "
            f"{packed.numel()}, {absmax.numel()}, {out.numel()}")
    if not out.is_contiguous():
        raise QuantizationError("nf4_dequantize_flat: the output must be contiguous")
    flat = out.view(-1)
    if not (native(flat) and packed.device.type == "cpu" and packed.is_contiguous()
            and absmax.device.type == "cpu" and absmax.dtype == torch.float32
            and absmax.is_contiguous()):
        flat.copy_(nf4_dequantize_ref(packed, absmax, n, block, torch.float32))
        return out
    ext, code, isz = _nf4_kernel(), _CODES[flat.dtype], flat.element_size()

    def run(e0, e1):
        ext.nf4_dequantize(packed.data_ptr() + e0 // 2, e1 - e0, block,
                           absmax.data_ptr() + 4 * (e0 // block), flat.data_ptr() + e0 * isz, code)
    _parallel(n, block, run)
    return out
