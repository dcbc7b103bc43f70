"""The blockwise quantizer against a per-group loop written out by hand, and its int32
packing against compressed-tensors' own packer (the format the export writes)."""
import math

import pytest
import torch

from infinity.quant import (QuantizationError, dequantize, fake_quantize, group_scales,
                            pack_bits, qrange, quantize, unpack_bits)


def _reference(x, bits, group):
    """One group at a time, the textbook way."""
    qmax = 2 ** (bits - 1) - 1
    rows = x.reshape(-1, x.shape[-1]).float()
    q = torch.empty_like(rows, dtype=torch.int8)
    scales = []
    for r in range(rows.shape[0]):
        srow = []
        for lo in range(0, rows.shape[1], group):
            g = rows[r, lo:lo + group]
            amax = g.abs().max().item()
            s = amax / qmax if amax > 0 else 1.0
            s = torch.tensor(s, dtype=torch.float32).item()
            q[r, lo:lo + group] = torch.clamp(torch.round(g / s), -qmax - 1, qmax).to(torch.int8)
            srow.append(s)
        scales.append(srow)
    return q.reshape(x.shape), torch.tensor(scales).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,group", [((7, 256), 128), ((5, 100), 32), ((3, 1), 128),
                                         ((1, 4097), 128), ((2, 3, 33), 16), ((4, 128), 128)])
def test_matches_reference_and_error_bound(bits, shape, group):
    torch.manual_seed(0)
    x = torch.randn(shape) * torch.logspace(-3, 1, shape[-1])   # groups of very different scales
    qt = quantize(x, bits, group)
    q_ref, s_ref = _reference(x, bits, group)
    assert qt.q.dtype == torch.int8 and qt.q.shape == x.shape
    assert qt.scale.shape == (*shape[:-1], math.ceil(shape[-1] / group))
    torch.testing.assert_close(qt.scale, s_ref, rtol=1e-6, atol=0)
    # rounding ties may land either way between the two divisions: at most one step off
    assert (qt.q.int() - q_ref.int()).abs().max() <= 1
    assert (qt.q.int() != q_ref.int()).float().mean() < 1e-3
    # error bound: half a step of each group's scale
    err = (qt.dequantize(torch.float32) - x).abs()
    step = dequantize(torch.ones_like(qt.q), qt.scale, group, dtype=torch.float32)
    assert bool((err <= step / 2 + 1e-6 * x.abs()).all())
    qmin, qmax = qrange(bits)
    assert int(qt.q.min()) >= qmin and int(qt.q.max()) <= qmax


def test_zeros_and_outliers():
    x = torch.zeros(4, 64)
    x[1, 5] = 1e4                  # one outlier: only its own group loses resolution
    x[2, 40:] = torch.linspace(-1, 1, 24)
    qt = quantize(x, 4, 32)
    assert bool((qt.scale[0] == 1).all()) and bool((qt.q[0] == 0).all())      # zero groups
    assert qt.scale[1, 0].item() == pytest.approx(1e4 / 7)
    assert qt.scale[1, 1].item() == 1.0                                        # untouched
    back = qt.dequantize(torch.float32)
    assert back[1, 5].item() == pytest.approx(1e4)
    assert torch.count_nonzero(back[0]) == 0 and torch.count_nonzero(back[3]) == 0
    torch.testing.assert_close(back[2, 40:], x[2, 40:], atol=1 / 14 + 1e-6, rtol=0)


def test_scale_dtype_rounded_before_quantizing():
    torch.manual_seed(1)
    x = torch.randn(16, 96)
    for dt in (torch.bfloat16, torch.float16):
        qt = quantize(x, 8, 32, scale_dtype=dt)
        assert qt.scale.dtype == dt
        # what a loader computes from the stored pieces is what dequantize gives
        mine = qt.dequantize(torch.float32)
        loader = (qt.q.float().reshape(16, 3, 32) * qt.scale.float().unsqueeze(-1)).reshape(16, 96)
        torch.testing.assert_close(mine, loader, rtol=0, atol=0)
        assert (mine - x).abs().max() <= qt.scale.float().max() / 2 + 1e-6
    tiny = torch.full((1, 8), 1e-30)          # would underflow a fp16 scale to 0
    qt = quantize(tiny, 8, 8, scale_dtype=torch.float16)
    assert qt.scale.item() > 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nonfinite_refused(bad):
    x = torch.randn(3, 10)
    x[2, 7] = bad
    with pytest.raises(QuantizationError, match=r"model\.w .*non-finite.*\(2, 7\)"):
        quantize(x, 8, 4, name="model.w")


def test_bad_arguments():
    with pytest.raises(QuantizationError, match="bits"):
        quantize(torch.ones(4), 3, 2)
    with pytest.raises(QuantizationError, match="group_size"):
        quantize(torch.ones(4), 8, 0)
    with pytest.raises(QuantizationError, match="floating point"):
        quantize(torch.ones(4, dtype=torch.int32), 8, 2)


def test_flat_shard_is_the_one_row_case():
    torch.manual_seed(2)
    flat = torch.randn(1000, dtype=torch.bfloat16)
    qt = quantize(flat.view(1, -1), 8, 256)
    assert qt.scale.shape == (1, 4)
    assert (qt.dequantize(torch.float32).view(-1) - flat.float()).abs().max() <= \
        qt.scale.max() / 2 + 1e-6


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("n", [1, 7, 8, 31, 32, 33, 100])
def test_pack_round_trip(bits, n):
    qmin, qmax = qrange(bits)
    q = torch.randint(qmin, qmax + 1, (3, n), dtype=torch.int8)
    packed = pack_bits(q, bits)
    assert packed.dtype == torch.int32 and packed.shape == (3, math.ceil(n * bits / 32))
    assert torch.equal(unpack_bits(packed, bits, n), q)


@pytest.mark.parametrize("bits", [8, 4])
def test_pack_matches_compressed_tensors(bits):
    helpers = pytest.importorskip("compressed_tensors.compressors.pack_quantized.helpers")
    qmin, qmax = qrange(bits)
    q = torch.randint(qmin, qmax + 1, (5, 77), dtype=torch.int8)
    assert torch.equal(pack_bits(q, bits), helpers.pack_to_int32(q, bits))
    assert torch.equal(helpers.unpack_from_int32(pack_bits(q, bits), bits, torch.Size((5, 77))), q)


def test_fake_quantize_matches_quantize_and_passes_gradients():
    torch.manual_seed(3)
    w = torch.randn(6, 50, requires_grad=True)
    fq = fake_quantize(w, 4, 16)
    torch.testing.assert_close(fq.detach(), quantize(w.detach(), 4, 16).dequantize(torch.float32))
    fq.sum().backward()
    assert w.grad is not None and torch.isfinite(w.grad).all() and w.grad.abs().sum() > 0
    s = group_scales(w.detach(), 4, 16).requires_grad_(True)       # learned-scale form
    fake_quantize(w.detach(), 4, 16, scale=s).pow(2).sum().backward()
    assert s.grad is not None and s.grad.abs().sum() > 0


def test_scales_are_a_correctly_rounded_division():
    """absmax / qmax rounded once (as the C++ kernel does), never a product with the
    reciprocal: CUDA computes ``x / 127`` that way for a Python divisor, one ulp off on an
    H200; the helper divides by a tensor, which every device rounds correctly."""
    from infinity.quant.blockwise import _div_qmax
    amax = torch.rand(100_000, generator=torch.Generator().manual_seed(4)) * 3
    for qmax in (127, 7):
        exact = (amax.double() / qmax).float()
        recip = amax * torch.tensor(1.0 / qmax, dtype=torch.float32)
        assert not torch.equal(recip, exact)          # the two do differ on these values
        assert torch.equal(_div_qmax(amax, qmax), exact)
