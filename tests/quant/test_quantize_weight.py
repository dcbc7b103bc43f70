"""The public weight quantizer (:func:`infinity.quant.quantize_weight`): round trips for
int8 / int4 / nf4 with and without double quantization over odd sizes, short tails, zeros
and outliers; the error bound of each format per block; the stored bytes; inf/NaN and bad
arguments refused with the tensor's name."""
import math

import pytest
import torch

from infinity.quant import (NF4_CODE, QuantizationError, QuantizedWeight, dequantize, quantize,
                            quantize_weight, unpack_bits)
from infinity.quant.nf4 import DQ_BLOCK, nf4_dequantize_ref, nf4_quantize_ref

DTYPES = ["nf4", "int8", "int4"]
QMAX = {"int8": 127, "int4": 7}
NF4_HALF_GAP = float((NF4_CODE[1:] - NF4_CODE[:-1]).max()) / 2


def _weights(shape, seed=0, dtype=torch.float32):
    """Gaussian weights whose blocks differ in scale, with a few exact zeros."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    x = torch.randn(n, generator=g) * torch.logspace(-2, 1, max(n, 1))[:n]
    x[::13] = 0
    return x.reshape(shape).to(dtype)


def _bound(qw: QuantizedWeight) -> torch.Tensor:
    """Per element: the worst rounding error of its block given the stored scales (half a
    step for the ints, half the widest code gap times absmax for nf4)."""
    s = qw.block_scales().repeat_interleave(qw.group_size)[:qw.numel]
    half = NF4_HALF_GAP if qw.dtype == "nf4" else 0.5
    return (s.abs() * half).reshape(qw.shape)


def _source_bound(qw, x):
    """With double quantization the scale itself moved: the error grows by |x| / absmax
    times that move, at most the scale error (|code| <= 1 for nf4, |q| <= qmax for int)."""
    if not qw.double_quant:
        return torch.zeros_like(x, dtype=torch.float32)
    flat = x.reshape(-1).float()
    bits = {"int8": 8, "int4": 4}
    if qw.dtype == "nf4":
        exact = nf4_quantize_ref(flat, qw.group_size)[1]
        mult = 1.0
    else:
        exact = quantize(flat.view(1, -1), bits[qw.dtype], qw.group_size).scale.reshape(-1)
        mult = QMAX[qw.dtype]
    ds = (qw.block_scales() - exact).abs() * mult
    return ds.repeat_interleave(qw.group_size)[:qw.numel].reshape(x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape,group", [((33, 65), 64), ((1,), 64), ((7,), 64), ((64, 64), 64),
                                         ((3, 5, 31), 128), ((257,), 32), ((1000, 17), 64),
                                         ((5, 11), 6), ((128, 129), 256)])
def test_round_trip_and_error_bound(dtype, double_quant, shape, group):
    x = _weights(shape, seed=sum(shape) + group)
    qw = quantize_weight(x, dtype, group, double_quant=double_quant, name="w")
    assert qw.shape == x.shape and qw.numel == x.numel() and qw.nblocks == math.ceil(x.numel() / group)
    assert qw.double_quant == double_quant and qw.orig_dtype == torch.float32
    back = qw.dequantize()
    assert back.shape == x.shape and back.dtype == torch.float32
    err = (back - x).abs()
    assert bool((err <= _bound(qw) * (1 + 1e-5) + _source_bound(qw, x) + 1e-7).all())
    # the stored pieces alone give the same values (what a reader of the format computes)
    if dtype == "nf4":
        manual = nf4_dequantize_ref(qw.data, qw.block_scales(), qw.numel, group)
    else:
        bits = {"int8": 8, "int4": 4}[dtype]
        q = qw.data.view(1, -1) if bits == 8 else unpack_bits(qw.data.view(1, -1), bits, qw.numel)
        manual = dequantize(q, qw.block_scales().view(1, -1), group, dtype=torch.float32)
    assert torch.equal(manual.reshape(x.shape), back)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_int_paths_equal_blockwise(dtype):
    """int8/int4 weights are the blockwise quantizer's (the ZeRO++ / export numerics) on
    the flat tensor: same scales, same integers -- kernel (group % 8 == 0) or torch."""
    bits = {"int8": 8, "int4": 4}[dtype]
    x = _weights((37, 29), seed=5)
    for group in (64, 12):
        qw = quantize_weight(x, dtype, group)
        ref = quantize(x.reshape(1, -1), bits, group)
        assert torch.equal(qw.scales, ref.scale.reshape(-1))
        q = qw.data if bits == 8 else unpack_bits(qw.data.view(1, -1), bits, x.numel()).view(-1)
        assert torch.equal(q.view(-1), ref.q.view(-1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_zeros(dtype, double_quant):
    for shape in [(0,), (5,), (64, 3), ()]:
        x = torch.zeros(shape)
        qw = quantize_weight(x, dtype, 64, double_quant=double_quant, name="z")
        back = qw.dequantize()
        assert back.shape == x.shape and torch.count_nonzero(back) == 0
        assert bool(torch.isfinite(qw.block_scales()).all())


@pytest.mark.parametrize("dtype", DTYPES)
def test_outlier_stays_in_its_block(dtype):
    x = _weights((8, 64), seed=2)
    x[3, 10] = 1e4
    qw = quantize_weight(x, dtype, 64)
    back = qw.dequantize()
    assert back[3, 10].item() == pytest.approx(1e4, rel=1e-6)
    others = torch.ones_like(x, dtype=torch.bool)
    others[3] = False                                  # every other block keeps its precision
    assert bool(((back - x).abs()[others] <= _bound(qw)[others] * (1 + 1e-5) + 1e-7).all())


def test_double_quant_saves_bytes():
    x = _weights((512, 512), seed=1)
    plain = quantize_weight(x, "nf4", 64)
    dq = quantize_weight(x, "nf4", 64, double_quant=True)
    n = x.numel()
    assert plain.nbytes == n // 2 + 4 * (n // 64)
    assert dq.nbytes == n // 2 + n // 64 + 4 * math.ceil(n // 64 / DQ_BLOCK) + 4
    # QLoRA: 0.5 bits per weight for the scales, 0.127 with double quantization
    assert plain.bits_per_element() == pytest.approx(4.5)
    assert dq.bits_per_element() == pytest.approx(4.127, abs=1e-3)
    assert quantize_weight(x, "int8", 64).nbytes == n + 4 * (n // 64)
    assert quantize_weight(x, "int4", 64).nbytes == n // 2 + 4 * (n // 64)
    rel = ((dq.dequantize() - x).norm() / (plain.dequantize() - x).norm()).item()
    assert rel < 1.05                                  # the scales cost almost nothing


@pytest.mark.parametrize("src", [torch.bfloat16, torch.float16])
def test_half_precision_source_and_targets(src):
    x = _weights((31, 70), seed=4, dtype=src)
    for dtype in DTYPES:
        qw = quantize_weight(x, dtype, 64)
        assert qw.orig_dtype == src and qw.dequantize().dtype == src
        wide = qw.dequantize(torch.float32)
        assert torch.equal(qw.dequantize(torch.bfloat16), wide.to(torch.bfloat16))
        assert bool(((wide - x.float()).abs() <= _bound(qw) * (1 + 1e-5) + 1e-7).all())
        ref = quantize_weight(x.float(), dtype, 64)      # the same codes from the fp32 copy
        assert torch.equal(qw.data, ref.data) and torch.equal(qw.scales, ref.scales)


def test_dequantize_into_out_and_to():
    x = _weights((40, 40), seed=6)
    qw = quantize_weight(x, "nf4", 64, double_quant=True)
    out = torch.empty(1600, dtype=torch.bfloat16)
    assert qw.dequantize(out=out) is out
    assert torch.equal(out.view(40, 40), qw.dequantize(torch.bfloat16))
    with pytest.raises(QuantizationError, match="out must be"):
        qw.dequantize(out=torch.empty(10))
    moved = qw.to("cpu")
    assert set(moved.tensors()) == {"data", "qscales", "scales2", "offset"}
    assert torch.equal(moved.dequantize(), qw.dequantize())


def test_non_contiguous_source():
    x = _weights((64, 48), seed=7).t()
    for dtype in DTYPES:
        a = quantize_weight(x, dtype, 64).dequantize()
        b = quantize_weight(x.contiguous(), dtype, 64).dequantize()
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_refused_with_name(dtype, bad):
    x = _weights((6, 10), seed=8)
    x[4, 7] = bad
    with pytest.raises(QuantizationError, match=r"model\.layers\.3\.mlp\.up_proj\.weight.*\(4, 7\)"):
        quantize_weight(x, dtype, 64, name="model.layers.3.mlp.up_proj.weight")


def test_bad_arguments():
    x = torch.randn(10)
    with pytest.raises(QuantizationError, match="dtype must be one of"):
        quantize_weight(x, "fp4", name="w")
    with pytest.raises(QuantizationError, match="group_size"):
        quantize_weight(x, "int8", 0, name="w")
    with pytest.raises(QuantizationError, match="group_size"):
        quantize_weight(x, "int8", True, name="w")
    with pytest.raises(QuantizationError, match="even"):
        quantize_weight(x, "nf4", 63, name="w")
    with pytest.raises(QuantizationError, match="not floating point"):
        quantize_weight(torch.arange(10), "nf4", name="idx")
    with pytest.raises(QuantizationError, match="torch.Tensor"):
        quantize_weight([1.0, 2.0], "nf4")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_cuda_equals_cpu(dtype, double_quant):
    x = _weights((300, 77), seed=9)
    cpu = quantize_weight(x, dtype, 64, double_quant=double_quant)
    gpu = quantize_weight(x.cuda(), dtype, 64, double_quant=double_quant)
    assert gpu.device.type == "cuda"
    for k, t in cpu.tensors().items():
        if k in ("offset", "qscales", "scales2"):     # a mean reduced in another order
            continue
        assert torch.equal(gpu.tensors()[k].cpu(), t), k
    torch.testing.assert_close(gpu.dequantize().cpu(), cpu.dequantize(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cpu.to("cuda").dequantize().cpu(), cpu.dequantize(), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("double_quant", [False, True])
def test_torch_path_equals_kernel_path(monkeypatch, dtype, double_quant):
    """The path CUDA tensors take (torch ops only), forced on CPU: the same bytes, scales
    and values as the C++ kernel's."""
    from infinity.quant import kernel
    x = _weights((123, 45), seed=10, dtype=torch.bfloat16)
    fast = quantize_weight(x, dtype, 64, double_quant=double_quant)
    monkeypatch.setattr(kernel, "native", lambda t: False)
    slow = quantize_weight(x, dtype, 64, double_quant=double_quant)
    assert fast.tensors().keys() == slow.tensors().keys()
    for k, t in fast.tensors().items():
        assert torch.equal(slow.tensors()[k], t), k
    for out_dtype in (torch.float32, torch.bfloat16):
        assert torch.equal(slow.dequantize(out_dtype), fast.dequantize(out_dtype))


@pytest.mark.parametrize("dtype,gs,dq", [("nf4", 64, True), ("int4", 12, False),
                                         ("int8", 64, False), ("nf4", 30, False)])
def test_dequantize_by_ranges_equals_whole(dtype, gs, dq):
    """The torch path (CUDA) dequantizes a pass of TORCH_PATH_CHUNK elements at a time,
    each a whole number of blocks (and of int4 words): ranges give the same values."""
    import math
    w = torch.randn(97, 131)
    q = quantize_weight(w, dtype, gs, double_quant=dq)
    ref = q.dequantize()
    out = torch.empty(w.numel())
    scales = q.block_scales().contiguous()
    unit = math.lcm(gs, 8) if dtype == "int4" else gs
    step = 1000 // unit * unit
    for e0 in range(0, w.numel(), step):
        q._dequantize_range(e0, min(w.numel(), e0 + step), scales,
                            out[e0:min(w.numel(), e0 + step)])
    assert torch.equal(out.view_as(ref), ref)


@pytest.mark.parametrize("dtype,gs", [("nf4", 64), ("int4", 64), ("int8", 128), ("nf4", 30)])
def test_kernels_split_across_threads_give_the_same_bytes(dtype, gs, monkeypatch):
    """Large tensors are quantized / dequantized in ranges of whole blocks on several
    threads (infinity.quant.kernel._parallel): the same payload, scales and values as one
    call on one thread."""
    import infinity.quant.kernel as K
    w = torch.randn(5 * (1 << 20) + 37).bfloat16()
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)
    monkeypatch.setattr(K, "PARALLEL_MIN", 1 << 20)
    par = quantize_weight(w, dtype, gs)
    par_out = par.dequantize()
    monkeypatch.setattr(K, "PARALLEL_MIN", 1 << 40)
    one = quantize_weight(w, dtype, gs)
    assert torch.equal(par.data, one.data) and torch.equal(par.scales, one.scales)
    assert torch.equal(par_out, one.dequantize())
