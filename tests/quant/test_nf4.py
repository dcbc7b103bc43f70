"""NF4 (QLoRA's 4-bit NormalFloat) and QLoRA's double quantization of the block scales:
the torch reference against a per-element nearest-code search written out by hand, the
C++ kernel bit for bit against the torch reference, and both against bitsandbytes' own
``quantize_4bit(quant_type="nf4")`` on CPU where bitsandbytes (>= 0.49, the `test` extra)
imports."""
import importlib.util
import math

import pytest
import torch

from infinity.quant import NF4_CODE, QuantizationError, double_dequantize, double_quantize
from infinity.quant import dynamic_code, quantize_weight
from infinity.quant.kernel import nf4_dequantize_flat, nf4_quantize_flat
from infinity.quant.nf4 import (DQ_BLOCK, nf4_dequantize_ref, nf4_quantize_ref, pack_nibbles,
                                unpack_nibbles)

HALF_GAP = float((NF4_CODE[1:] - NF4_CODE[:-1]).max()) / 2     # 0.1385: the widest half-step


def _mixed(n, seed=0, dtype=torch.float32):
    """Random values whose blocks differ in scale by five orders of magnitude, some zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 2, n)[torch.randperm(n, generator=g)]
    x[::11] = 0
    return x.to(dtype)


def _bnb():
    """bitsandbytes.functional when a CPU-capable bitsandbytes >= 0.49 imports, else skip."""
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes not installed (the `test` extra): no peer to compare against")
    import bitsandbytes
    from bitsandbytes import functional as F
    major, minor = (int(v) for v in bitsandbytes.__version__.split(".")[:2])
    if (major, minor) < (0, 49):
        pytest.skip(f"bitsandbytes {bitsandbytes.__version__} < 0.49 has no CPU backend")
    return F


def _nearest_by_hand(x, block):
    """Per block, per element: the index of the nearest NF4 code to x / absmax (a tie: the
    lower), and the block absmaxes -- no midpoints, no bucketize."""
    flat = x.reshape(-1).float()
    codes, absmaxes = [], []
    for lo in range(0, flat.numel(), block):
        g = flat[lo:lo + block]
        amax = g.abs().max()
        absmaxes.append(amax)
        inv = 1.0 / amax.clamp(min=1e-38)
        v = (g * inv).clamp(-1, 1)
        d = (v.unsqueeze(-1) - NF4_CODE).abs()
        codes.append(d.argmin(dim=-1))                 # argmin: the first (lower) of a tie
    return torch.cat(codes), torch.stack(absmaxes)


@pytest.mark.parametrize("n,block", [(1, 64), (2, 64), (63, 64), (64, 64), (65, 64),
                                     (1001, 64), (4097, 128), (777, 2), (300, 66)])
def test_reference_is_the_nearest_code(n, block):
    x = _mixed(n, seed=n)
    packed, absmax = nf4_quantize_ref(x, block)
    assert packed.dtype == torch.uint8 and packed.numel() == math.ceil(n / 2)
    assert absmax.dtype == torch.float32 and absmax.numel() == math.ceil(n / block)
    codes = unpack_nibbles(packed, n).long()
    want, amax = _nearest_by_hand(x, block)
    torch.testing.assert_close(absmax, amax, rtol=0, atol=0)
    # a value a hair from a midpoint may round either way between the two formulations
    diff = codes != want
    assert diff.float().mean() < 1e-3
    if bool(diff.any()):
        v = (x.reshape(-1).float() / absmax.repeat_interleave(block)[:n])[diff]
        mids = (NF4_CODE[codes[diff]] + NF4_CODE[want[diff]]) / 2
        assert bool(((v - mids).abs() < 1e-6).all())
    if n % 2:                                          # the pad nibble: code 7 (0.0)
        assert int(packed[-1]) & 0xF == 7


@pytest.mark.parametrize("n", [1, 3, 64, 1000, 65537])
def test_error_bound_per_block(n):
    """|x - x'| <= absmax * (half the widest gap of the code book) in every block, and the
    block's absmax element comes back exactly (code +-1)."""
    x = _mixed(n, seed=3)
    packed, absmax = nf4_quantize_ref(x, 64)
    back = nf4_dequantize_ref(packed, absmax, n, 64)
    bound = absmax.repeat_interleave(64)[:n] * HALF_GAP * (1 + 1e-6)
    assert bool(((back - x).abs() <= bound).all())
    for b in range(0, n, 64):
        blk = x[b:b + 64]
        i = int(blk.abs().argmax())
        assert back[b + i].item() == blk[i].item()


def test_zeros_and_outliers():
    x = torch.zeros(4 * 64)
    x[70] = 1e6                                       # an outlier in block 1
    x[128:192] = torch.linspace(-1, 1, 64)            # a plain block
    packed, absmax = nf4_quantize_ref(x, 64)
    back = nf4_dequantize_ref(packed, absmax, x.numel(), 64)
    assert absmax[0].item() == 0 and absmax[3].item() == 0          # all-zero blocks
    assert torch.count_nonzero(back[:64]) == 0 and torch.count_nonzero(back[192:]) == 0
    assert back[70].item() == 1e6 and torch.count_nonzero(back[64:128]) == 1
    assert (back[128:192] - x[128:192]).abs().max() <= HALF_GAP + 1e-6   # untouched by it
    codes = unpack_nibbles(packed, x.numel())
    assert bool((codes[:64] == 7).all())                            # 0.0 is code 7


def test_nibble_order():
    codes = torch.tensor([1, 2, 15, 0, 9], dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.tolist() == [0x12, 0xF0, 0x97]      # element 2k high, 2k+1 low, pad 7
    assert torch.equal(unpack_nibbles(packed, 5), codes)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,block", [(1, 64), (65, 64), (4097, 64), (100003, 256), (9, 2),
                                     (10000, 8192)])
def test_kernel_bit_identical_to_reference(dtype, n, block):
    x = _mixed(n, seed=n + block, dtype=dtype)
    packed, absmax = nf4_quantize_flat(x, block)
    ref_p, ref_a = nf4_quantize_ref(x, block)
    assert torch.equal(packed, ref_p) and torch.equal(absmax, ref_a)
    for out_dtype in (torch.float32, torch.bfloat16, torch.float16):
        out = torch.empty(n, dtype=out_dtype)
        nf4_dequantize_flat(packed, absmax, n, block, out)
        assert torch.equal(out, nf4_dequantize_ref(packed, absmax, n, block, out_dtype))


def test_kernel_bad_arguments():
    with pytest.raises(QuantizationError, match="even"):
        nf4_quantize_flat(torch.randn(10), 63)
    p, a = nf4_quantize_flat(torch.randn(10), 4)
    with pytest.raises(QuantizationError, match="need 5 uint8 bytes"):
        nf4_dequantize_flat(p[:4], a, 10, 4, torch.empty(10))


# ---- double quantization --------------------------------------------------------------

def test_dynamic_code_shape():
    code = dynamic_code()
    assert code.numel() == 256 and bool((code[1:] > code[:-1]).all())
    assert code[-1].item() == 1.0 and 0.0 in code.tolist() and code[0].item() < -0.99


@pytest.mark.parametrize("nscales", [1, 255, 256, 257, 1000])
def test_double_quant_round_trip(nscales):
    g = torch.Generator().manual_seed(nscales)
    s = torch.rand(nscales, generator=g) * 3 + 0.01
    s[::17] = 0                                        # all-zero weight blocks
    q, s2, off = double_quantize(s)
    assert q.dtype == torch.uint8 and q.numel() == nscales
    assert s2.numel() == math.ceil(nscales / DQ_BLOCK) and off.dim() == 0
    assert off.item() == pytest.approx(s.mean().item())
    back = double_dequantize(q, s2, off)
    # the dynamic code's widest step is 0.9 / 64 (near +-1): half of it per unit of absmax2
    bound = s2.repeat_interleave(DQ_BLOCK)[:nscales] * (0.9 / 64 / 2) + 1e-6
    assert bool(((back - s).abs() <= bound).all())


def test_double_quant_constant_scales():
    s = torch.full((300,), 0.25)
    q, s2, off = double_quantize(s)
    assert bool((s2 == 0).all())
    assert torch.equal(double_dequantize(q, s2, off), s)


# ---- against bitsandbytes ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(64,), (256,), (33, 65), (7, 1000), (4097,), (3, 5, 31)])
def test_codes_and_absmax_equal_bitsandbytes(dtype, shape):
    F = _bnb()
    x = _mixed(math.prod(shape), seed=sum(shape), dtype=dtype).reshape(shape)
    q_bnb, state = F.quantize_4bit(x, blocksize=64, quant_type="nf4")
    qw = quantize_weight(x, "nf4", 64)
    assert torch.equal(qw.data, q_bnb.reshape(-1))
    assert torch.equal(qw.scales, state.absmax)
    ours = qw.dequantize()
    theirs = F.dequantize_4bit(q_bnb, state)         # (1-D input: bitsandbytes adds a dim)
    assert ours.dtype == theirs.dtype == dtype and ours.shape == x.shape
    torch.testing.assert_close(ours, theirs.reshape(shape), rtol=0, atol=0)


def test_code_books_equal_bitsandbytes():
    F = _bnb()
    assert torch.equal(F.get_4bit_type("nf4", device="cpu"), NF4_CODE)
    assert torch.equal(F.create_dynamic_map(signed=True), dynamic_code())


@pytest.mark.parametrize("n", [64 * 256, 64 * 300 + 5, 64 * 1000])
def test_double_quant_statistics_match_bitsandbytes(n):
    """``compress_statistics=True``: the same offset and second-level absmaxes; the 8-bit
    codes of the scales equal bitsandbytes' except where its CPU binary search lands one
    code below the nearest (a few near-midpoint scales): there, one step apart, and ours
    is the nearer."""
    F = _bnb()
    x = _mixed(n, seed=n)
    q_bnb, state = F.quantize_4bit(x, blocksize=64, quant_type="nf4", compress_statistics=True)
    qw = quantize_weight(x, "nf4", 64, double_quant=True)
    assert torch.equal(qw.data, q_bnb.reshape(-1))
    assert qw.offset.item() == state.offset.item()
    assert torch.equal(qw.scales2, state.state2.absmax)
    ours, theirs = qw.qscales.long(), state.absmax.long()
    diff = ours != theirs
    assert diff.float().mean() < 0.02
    assert bool(((ours - theirs).abs() <= 1).all())
    if bool(diff.any()):
        code = dynamic_code()
        raw = nf4_quantize_ref(x, 64)[1] - qw.offset
        v = raw / qw.scales2.repeat_interleave(DQ_BLOCK)[:raw.numel()]
        assert bool(((v - code[ours]).abs() <= (v - code[theirs]).abs() + 1e-7)[diff].all())
    # and the weights come back within the reconstruction of bitsandbytes' own scales
    theirs_w = F.dequantize_4bit(q_bnb, state)
    scale_err = (qw.block_scales() - (F.dequantize_blockwise(state.absmax, state.state2)
                                      + state.offset)).abs().max()
    assert (qw.dequantize() - theirs_w).abs().max() <= scale_err * 1.0 + 1e-6
