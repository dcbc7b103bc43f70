"""The round trips ZeRO++ puts on the wire, tested directly: qwZ (int8, fp32 scale per
WEIGHT_BLOCK) on bf16/fp32 shards and qgZ (int4 packed into int32 words, fp32 scale per
GRAD_BLOCK) on fp32 gradients -- random blocks and adversarial ones (zeros, one huge
outlier, denormals, inf/NaN).  Reference: a per-block loop written out by hand (bound:
half a quantization step of each block, |x - x'| <= absmax / qmax / 2)."""
import pytest
import torch

from infinity.quant import dequantize, pack_bits, quantize, unpack_bits
from infinity.quant.kernel import dequantize_flat, native, quantize_flat
from infinity.zero.zeropp import (GRAD_BITS, GRAD_BLOCK, WEIGHT_BITS, WEIGHT_BLOCK,
                                  qgz_wire_bytes, qwz_wire_bytes)


def qwz_round_trip(x):
    """What qwZ sends and rebuilds: the C++ kernel (infinity/quant/kernel.py)."""
    q, sc = quantize_flat(x, WEIGHT_BITS, WEIGHT_BLOCK)
    assert q.dtype == torch.int8 and q.numel() == x.numel()
    back = dequantize_flat(q, sc, x.numel(), WEIGHT_BITS, WEIGHT_BLOCK,
                           torch.empty(x.numel(), dtype=torch.float32))
    return back, QT(q, sc)


def qgz_round_trip(x):
    q, sc = quantize_flat(x, GRAD_BITS, GRAD_BLOCK)
    assert q.dtype == torch.int32 and q.numel() == -(-x.numel() // 8)
    back = dequantize_flat(q, sc, x.numel(), GRAD_BITS, GRAD_BLOCK,
                           torch.empty(x.numel(), dtype=torch.float32))
    return back, QT(unpack_bits(q.view(1, -1), 4, x.numel()), sc)


class QT:
    def __init__(self, q, scale):
        self.q, self.scale = q, scale


def block_bound(x, block, bits):
    """Per element: half a step of its block (absmax / qmax / 2), by hand."""
    qmax = 2 ** (bits - 1) - 1
    xf = x.float().reshape(-1)
    out = torch.empty_like(xf)
    for lo in range(0, xf.numel(), block):
        amax = xf[lo:lo + block].abs().max().item()
        step = max(amax / qmax, torch.finfo(torch.float32).tiny) if amax > 0 else 1.0
        out[lo:lo + block] = step / 2
    return out


CASES = {
    "random": lambda n: torch.randn(n) * torch.logspace(-4, 2, n),
    "zeros": lambda n: torch.zeros(n),
    "outlier": lambda n: torch.cat([torch.full((1,), 3e4), torch.randn(n - 1) * 1e-3]),
    "denormal": lambda n: torch.full((n,), 1e-41) * torch.randn(n).sign(),
    "mixed-denormal": lambda n: torch.cat([torch.full((n // 2,), 2e-40), torch.randn(n - n // 2)]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", [WEIGHT_BLOCK, 2048, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qwz_round_trip_bound(case, n, dtype):
    torch.manual_seed(n)
    x = CASES[case](n).to(dtype)
    back, qt = qwz_round_trip(x)
    err = (back - x.float()).abs()
    bound = block_bound(x, WEIGHT_BLOCK, WEIGHT_BITS)
    assert bool((err <= bound * (1 + 1e-6) + 1e-6 * x.float().abs() + 1e-45).all()), \
        (case, float((err - bound).max()))
    assert bool(torch.isfinite(back).all())
    if case == "zeros":
        assert torch.count_nonzero(back) == 0
    if case == "outlier":
        assert back[0].item() == pytest.approx(x[0].item(), rel=1e-6)   # the outlier: exact
    # bytes on the wire: int8 + fp32 scale per block
    assert qt.q.numel() + 4 * qt.scale.numel() == qwz_wire_bytes(n)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("n", [GRAD_BLOCK, 4096, 1000])
def test_qgz_round_trip_bound(case, n):
    torch.manual_seed(n + 1)
    x = CASES[case](n)
    back, qt = qgz_round_trip(x)
    err = (back - x).abs()
    bound = block_bound(x, GRAD_BLOCK, GRAD_BITS)
    assert bool((err <= bound * (1 + 1e-6) + 1e-6 * x.float().abs() + 1e-45).all()), \
        (case, float((err - bound).max()))
    assert int(qt.q.min()) >= -8 and int(qt.q.max()) <= 7
    assert 4 * -(-n // 8) + 4 * qt.scale.numel() == qgz_wire_bytes(n)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("trip", [qwz_round_trip, qgz_round_trip])
def test_nonfinite_poisons_only_its_block(bad, trip):
    """Documented handling: a block holding inf/NaN dequantizes to NaN as a whole (its
    scale is NaN); every other block is untouched, so a non-finite gradient still makes
    the global norm non-finite (the step is skipped) and nothing raises mid-collective."""
    blk = WEIGHT_BLOCK if trip is qwz_round_trip else GRAD_BLOCK
    torch.manual_seed(5)
    x = torch.randn(4 * 256)
    x[300] = bad
    lo = 300 // blk * blk
    back, qt = trip(x)
    assert bool(torch.isnan(back[lo:lo + blk]).all())
    keep = torch.cat([back[:lo], back[lo + blk:]])
    assert bool(torch.isfinite(keep).all())
    ref, _ = trip(torch.cat([x[:lo], torch.zeros(blk), x[lo + blk:]]))
    assert torch.equal(keep, torch.cat([ref[:lo], ref[lo + blk:]]))
    assert int(qt.q.reshape(-1)[lo:lo + blk].abs().max()) == 0
    assert bool(torch.isnan(qt.scale[lo // blk]))


def test_raise_mode_still_refuses():
    x = torch.randn(512)
    x[3] = float("nan")
    from infinity.quant import QuantizationError
    with pytest.raises(QuantizationError, match="non-finite"):
        quantize(x.view(1, -1), 8, 256)
    with pytest.raises(QuantizationError, match="nonfinite"):
        quantize(x.view(1, -1), 8, 256, nonfinite="zero")


def test_nan_mode_equals_raise_mode_on_finite_input():
    torch.manual_seed(9)
    for dt in (torch.float32, torch.bfloat16):
        x = (torch.randn(3, 1000) * 10).to(dt)
        for bits in (8, 4):
            a = quantize(x, bits, 256)
            b = quantize(x, bits, 256, nonfinite="nan")
            assert torch.equal(a.q, b.q) and torch.equal(a.scale, b.scale)


ADVERSARIAL = {
    "random": lambda n: torch.randn(n) * torch.logspace(-6, 3, n),
    "zeros": lambda n: torch.zeros(n),
    "outlier": lambda n: torch.cat([torch.randn(n - 1) * 1e-3, torch.full((1,), -7e4)]),
    "denormal": lambda n: torch.full((n,), 3e-41) * torch.randn(n),
    "ties": lambda n: (torch.arange(n) % 15 - 7).float() * 0.5,      # x / s lands on .5
    "nonfinite": lambda n: torch.randn(n).index_fill_(0, torch.tensor([0, n // 2, n - 1]),
                                                      float("nan")).index_fill_(
        0, torch.tensor([n // 3]), float("inf")),
}


@pytest.mark.parametrize("case", sorted(ADVERSARIAL))
@pytest.mark.parametrize("n", [1, 7, 64, 1000, 4096, 4099])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits,block", [(8, WEIGHT_BLOCK), (4, GRAD_BLOCK), (8, 5)])
def test_kernel_is_the_torch_path_bit_for_bit(case, n, dtype, bits, block):
    """The C++ kernel gives exactly blockwise.quantize(nonfinite="nan") (+ pack_bits) and
    blockwise.dequantize: same scales, integers, packing, dequantized values."""
    torch.manual_seed(n)
    x = ADVERSARIAL[case](n).to(dtype)
    assert native(x)
    q, sc = quantize_flat(x, bits, block)
    ref = quantize(x.view(1, -1), bits, block, nonfinite="nan")
    ref_q = ref.q.reshape(-1) if bits == 8 else pack_bits(ref.q, bits).reshape(-1)
    assert torch.equal(q, ref_q)
    assert torch.equal(sc, ref.scale.reshape(-1)) or torch.allclose(
        sc, ref.scale.reshape(-1), rtol=0, atol=0, equal_nan=True)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = dequantize_flat(q, sc, n, bits, block, torch.empty(n, dtype=out_dtype))
        want = dequantize(ref.q, ref.scale, block, dtype=out_dtype).reshape(-1)
        assert torch.allclose(got.float(), want.float(), rtol=0, atol=0, equal_nan=True)


def test_kernel_argument_checks():
    from infinity.quant import QuantizationError
    x = torch.randn(64)
    with pytest.raises(QuantizationError, match="bits"):
        quantize_flat(x, 2, 64)
    with pytest.raises(QuantizationError, match="multiple of 8"):
        quantize_flat(x, 4, 12)
    q, sc = quantize_flat(x, 8, 64)
    with pytest.raises(QuantizationError, match="payload"):
        dequantize_flat(q[:10], sc, 64, 8, 64, torch.empty(64))
    with pytest.raises(QuantizationError, match="contiguous"):
        dequantize_flat(q, sc, 64, 8, 64, torch.empty(64, 2)[:, 0])
