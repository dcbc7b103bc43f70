"""aligned_empty: alignment, dtypes, locking, deterministic release."""
import gc

import pytest
import torch

from infinity.io import aligned_empty, is_aligned


def _mapped(ptr):
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= ptr < hi:
                return True
    return False


def _vmlck_kb():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmLck:"):
                return int(line.split()[1])
    return 0


@pytest.mark.parametrize("numel,dtype", [(0, torch.uint8), (1, torch.float32), (4097, torch.bfloat16),
                                         (1 << 20, torch.float32), (12345, torch.int64)])
def test_alignment_and_dtype(numel, dtype):
    t = aligned_empty(numel, dtype)
    assert t.dtype == dtype and t.shape == (numel,) and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0
    t.fill_(1)
    assert bool((t == 1).all())


def test_locked_and_freed_deterministically():
    lck0 = _vmlck_kb()
    t = aligned_empty(32 << 20)
    ptr = t.data_ptr()
    assert _mapped(ptr)
    assert _vmlck_kb() - lck0 >= 32 << 10  # root here: mlock permitted
    view = t[4096:]
    del t
    gc.collect()
    assert _mapped(ptr)  # a view keeps it alive
    del view
    assert not _mapped(ptr)  # refcount drop unmaps at once
    assert _vmlck_kb() - lck0 < 32 << 10


def test_is_aligned_and_errors():
    assert is_aligned(aligned_empty(8192))
    assert not is_aligned(aligned_empty(8192)[1:])
    with pytest.raises(ValueError):
        aligned_empty(-1)
    with pytest.raises(ValueError):
        aligned_empty(10, "float32")
