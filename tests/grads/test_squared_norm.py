"""The host gradient norm (infinity/grads/norm.py): a 3B model's gradients on an H200's host
took 1.28 s with one ``torch.linalg.vector_norm`` per buffer (one thread, a running fp32
sum).  ``squared_norm`` reduces by rows on torch's threads and sums the rows exactly:
against an fp64 reference, the same value whatever the thread count, and the edge cases
(empty, one row, a tail, inf/NaN, 16-bit buffers)."""
import math

import pytest
import torch

from infinity.grads.norm import ROW, squared_norm


def _ref(t):
    return float(t.double().pow(2).sum())


@pytest.mark.parametrize("n", [0, 1, 7, ROW - 1, ROW, ROW + 3, 37 * ROW + 1001])
def test_against_fp64(n):
    t = torch.randn(n, generator=torch.Generator().manual_seed(n))
    got, want = squared_norm(t), _ref(t)
    assert math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-30), (n, got, want)


def test_large_buffer_is_accurate_where_one_fp32_sum_is_not():
    t = torch.randn(20_000_000, generator=torch.Generator().manual_seed(1))
    want = _ref(t)
    assert abs(squared_norm(t) - want) / want < 1e-6
    # (what the boundary step computed before: one running fp32 sum)
    whole = float(torch.linalg.vector_norm(t)) ** 2
    assert abs(whole - want) / want > 10 * abs(squared_norm(t) - want) / want


def test_the_same_value_whatever_the_thread_count():
    t = torch.randn(5 * ROW + 17, generator=torch.Generator().manual_seed(2))
    old = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = squared_norm(t)
        torch.set_num_threads(max(2, old))
        many = squared_norm(t)
    finally:
        torch.set_num_threads(old)
    assert one == many


def test_shapes_dtypes_and_nonfinite():
    t = torch.randn(3, 5, ROW // 4, generator=torch.Generator().manual_seed(3))
    assert math.isclose(squared_norm(t), _ref(t), rel_tol=1e-6)
    b = t.bfloat16()
    assert math.isclose(squared_norm(b), _ref(b.float()), rel_tol=1e-5)
    bad = torch.ones(3 * ROW)
    bad[ROW + 5] = float("inf")
    assert squared_norm(bad) == float("inf")
    bad[ROW + 5] = float("nan")
    assert math.isnan(squared_norm(bad))
