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


def test_cuda_unregister_runs_before_the_unmap(monkeypatch):
    """With CUDA, aligned_empty registers the mapping and unregisters it when the last view
    dies — while the memory is still mapped (cudaHostUnregister after munmap is an error)."""
    import gc

    import infinity.io.buffers as B
    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            calls.append(("register", ptr, nbytes, _mapped(ptr)))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr, None, _mapped(ptr)))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    B.aligned_empty(4096, lock=False)        # no CUDA engine yet: nothing registered
    assert calls == []
    monkeypatch.setattr(B, "_pin_for_cuda", True)    # as enable_cuda_pinning() does
    t = B.aligned_empty(3 * 4096 + 5, torch.float32, lock=False)
    ptr = t.data_ptr()
    view = t[10:20]
    del t
    gc.collect()
    assert [c[0] for c in calls] == ["register"] and calls[0][3]
    view.fill_(1.0)                          # a view keeps the registration and the memory
    del view
    gc.collect()
    assert [c[0] for c in calls] == ["register", "unregister"], calls
    assert calls[1][1] == ptr and calls[1][3], "unregistered after the memory was unmapped"
    assert not _mapped(ptr)                  # and then it was unmapped


def test_failed_cuda_registration_warns_with_the_consequence(monkeypatch, caplog):
    import infinity.io.buffers as B

    class FailingCudart:
        def cudaHostRegister(self, ptr, nbytes, flags):
            return 2                          # cudaErrorMemoryAllocation

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FailingCudart())
    monkeypatch.setattr(B, "_pin_for_cuda", True)
    monkeypatch.setattr(B, "_warned", set())
    with caplog.at_level("WARNING", logger="infinity.io"):
        t = B.aligned_empty(4096, lock=False)
    t.fill_(1)                                # still a usable (unpinned) buffer
    msg = " ".join(r.getMessage() for r in caplog.records)
    assert "cudaHostRegister of 4096 bytes failed (code 2)" in msg
    assert "no longer overlaps compute" in msg



def _thp_mode():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "never"


def _vmflags(ptr):
    """The VmFlags of the mapping holding ``ptr`` in /proc/self/smaps (None if absent)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0] if line.strip() else ""
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and line.startswith("VmFlags:"):
                return line.split()[1:]
    return None


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages disabled on this host")
def test_large_buffers_ask_for_huge_pages():
    # Physically contiguous memory keeps an O_DIRECT request to a few DMA segments; a
    # fragmented 4 KiB-page buffer measured ~2-3x slower on a virtio disk (docs/benchmarks.md).
    big, small = aligned_empty(8 << 20), aligned_empty(64 << 10)
    flags = _vmflags(big.data_ptr())
    if flags is None:
        pytest.skip("/proc/self/smaps has no VmFlags")
    assert "hg" in flags, f"8 MiB buffer mapping lacks MADV_HUGEPAGE: VmFlags {flags}"
    assert "hg" not in (_vmflags(small.data_ptr()) or []), "buffers under 2 MiB need no huge pages"
