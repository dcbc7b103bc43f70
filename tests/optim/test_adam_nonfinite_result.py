"""Note [non-finite result]: every Adam kernel (each ISA this CPU has) reports whether a
result came out non-finite *as stored* -- checked against the bytes it wrote: the flag
is False exactly when the fp32 master, both moments (in their dtype) and ``param_out``
(in its dtype) read back all finite.  Overflows are placed at every lane of a vector,
in the head, body and tail of a range, on aligned and unaligned views."""
import pytest
import torch

import infinity.optim as iopt

LEVELS = [lv for lv in iopt.SIMD_LEVELS if iopt.cpu_supports(lv)]
HP = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0)


@pytest.fixture(params=LEVELS)
def level(request):
    before = iopt.simd_level()
    iopt.select_simd(request.param)
    yield request.param
    iopt.select_simd(before)


def _stored_finite(p, m, v, out):
    return bool(torch.isfinite(p).all() and torch.isfinite(m).all() and torch.isfinite(v).all()
                and (out is None or torch.isfinite(out).all()))


def _step(p, g, m, v, out, lr=1e-3):
    return iopt.adam_step(p, g, m, v, step=1, lr=lr, param_out=out, **HP)


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("out_dtype", [None, torch.float16, torch.bfloat16])
def test_flag_equals_what_was_stored(level, state_dtype, out_dtype):
    """A huge gradient (exp_avg_sq overflows), a NaN gradient, or nothing wrong, at every
    position of small ranges (one vector, head/body/tail) and one unaligned offset."""
    for n in (1, 5, 8, 16, 17, 40):
        for start in (0, 1):
            for pos in range(n):
                for bad in (1e30, float("nan"), None):
                    base = torch.randn(n + start)
                    g = torch.randn(n + start) * 0.1
                    if bad is not None:
                        g[start + pos] = bad
                    p = base[start:]
                    m = torch.zeros(n + start, dtype=state_dtype)[start:]
                    v = torch.zeros(n + start, dtype=state_dtype)[start:]
                    out = None if out_dtype is None else torch.empty(n + start, dtype=out_dtype)[start:]
                    ok = _step(p, g[start:], m, v, out)
                    assert ok is _stored_finite(p, m, v, out), (level, n, start, pos, bad)
                    assert ok is (bad is None), (level, n, start, pos, bad)


@pytest.mark.parametrize("out_dtype,finite,overflow", [
    (torch.float16, 65519.99, 65520.0),                   # halfway to 65536 rounds to inf
    (torch.bfloat16, float.fromhex("0x1.FEFFFEp127"), float.fromhex("0x1.FFp127")),
])
def test_param_out_range_is_exact(level, out_dtype, finite, overflow):
    """The low-precision copy's range: the last master value that rounds to a finite copy
    is not flagged, the first that rounds to inf is (lr 0: the master stays put)."""
    for value, want in ((finite, True), (overflow, False), (-overflow, False)):
        for n in (3, 16, 37):
            p = torch.zeros(n)
            p[n // 2] = value
            out = torch.empty(n, dtype=out_dtype)
            ok = _step(p, torch.zeros(n), torch.zeros(n), torch.zeros(n), out, lr=0.0)
            assert ok is want and ok is _stored_finite(p, p, p, out), (level, value, n)


def test_large_parallel_range_flags_one_element(level):
    """Over the thread pool's chunks: one overflowing element anywhere is reported."""
    n = 1 << 20
    for pos in (0, n // 3, n - 1):
        g = torch.randn(n) * 0.1
        g[pos] = 1e30
        p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
        assert _step(p, g, m, v, None) is False
        assert not torch.isfinite(v[pos])
    p, m, v = torch.randn(n), torch.zeros(n), torch.zeros(n)
    assert _step(p, torch.randn(n), m, v, None) is True


def test_empty_is_finite():
    e = torch.empty(0)
    assert _step(e, e, e.clone(), e.clone(), None) is True
