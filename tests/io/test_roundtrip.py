"""Round trips through AioEngine: bytes read back equal bytes written."""
import os
import sys

import pytest
import torch

from infinity.io import AioEngine, AioError, aligned_empty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from iotest_helpers import ENGINES, engine_or_skip, random_bytes  # noqa: E402

SIZES = [1, 7, 4095, 4096, 4097, (1 << 20) - 1, 1 << 20, (1 << 20) + 1]
OFFSETS = [0, 1, 4095, 4096, 12345]


@pytest.mark.parametrize("size", SIZES)
def test_roundtrip_sizes_offsets(engine, tmp_path, size):
    path = tmp_path / "f.bin"
    for i, off in enumerate(OFFSETS):
        src = random_bytes(size, seed=size + i)
        assert engine.pwrite(src, path, off).wait() == size
        dst = torch.zeros(size, dtype=torch.uint8)
        assert engine.pread(dst, path, off).wait() == size
        assert torch.equal(src, dst), f"size {size} offset {off}"
        # the file is exactly as long as the data (no padding left by the engine)
        assert os.path.getsize(path) == max(off + size, os.path.getsize(path))
    raw = open(path, "rb").read()
    assert raw[OFFSETS[-1]:OFFSETS[-1] + size] == bytes(src.numpy())


@pytest.mark.parametrize("kind", ENGINES)
def test_file_size_exact_after_unaligned_tail(kind, tmp_path):
    with engine_or_skip(kind) as e:
        src = random_bytes(4097)
        e.pwrite(src, tmp_path / "a", 0).wait()
    assert os.path.getsize(tmp_path / "a") == 4097
    assert open(tmp_path / "a", "rb").read() == bytes(src.numpy())


@pytest.mark.parametrize("kind", ENGINES)
def test_unaligned_address_and_dtypes(kind, tmp_path):
    """Tensors at odd addresses (views) and of other dtypes go through bounce buffers."""
    with engine_or_skip(kind, block_size=1 << 16, queue_depth=4) as e:
        base = random_bytes(300_003)
        src = base[3:]  # address not aligned
        e.pwrite(src, tmp_path / "b", 8192).wait()
        out = torch.zeros(300_001, dtype=torch.uint8)[1:]
        e.pread(out, tmp_path / "b", 8192).wait()
        assert torch.equal(out, src)
        f32 = torch.randn(12345)
        e.pwrite(f32, tmp_path / "c", 4096).wait()
        back = torch.empty(12345)
        e.pread(back, tmp_path / "c", 4096).wait()
        assert torch.equal(back, f32)


@pytest.mark.parametrize("kind", ENGINES)
def test_aligned_fast_path_large(kind, tmp_path):
    with engine_or_skip(kind, block_size=1 << 20, queue_depth=16) as e:
        n = 8 << 20
        src = aligned_empty(n)
        src.copy_(random_bytes(n, seed=3))
        f = e.open(tmp_path / "big", create=True)
        assert e.pwrite(src, f, 0).wait() == n
        dst = aligned_empty(n)
        assert e.pread(dst, f, 0).wait() == n
        assert torch.equal(src, dst)


def test_data_corruption_would_be_detected(tmp_path):
    """The comparison used by these tests can fail: flip one byte on disk."""
    with AioEngine(engine="posix") as e:
        src = random_bytes(5000)
        e.pwrite(src, tmp_path / "x", 0).wait()
        with open(tmp_path / "x", "r+b") as f:
            f.seek(4100)
            b = f.read(1)
            f.seek(4100)
            f.write(bytes([b[0] ^ 0xFF]))
        dst = torch.empty(5000, dtype=torch.uint8)
        e.pread(dst, tmp_path / "x", 0).wait()
        assert not torch.equal(src, dst)


@pytest.mark.parametrize("kind", ENGINES)
def test_read_past_end_raises(kind, tmp_path):
    with engine_or_skip(kind) as e:
        e.pwrite(random_bytes(5000), tmp_path / "s", 0).wait()
        for n, off in [(5001, 0), (10, 4999), (4096, 8192), (100, 5000)]:
            with pytest.raises(AioError) as ei:
                e.pread(torch.empty(n, dtype=torch.uint8), tmp_path / "s", off).wait()
            assert ei.value.filename and "s" in ei.value.filename
            assert "past the end" in str(ei.value)


def test_non_contiguous_and_bad_tensors(engine, tmp_path):
    t = torch.zeros(64, 64)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        engine.pwrite(t, tmp_path / "n", 0)
    with pytest.raises(ValueError):
        engine.pread([1, 2, 3], tmp_path / "n", 0)
    with pytest.raises(ValueError):
        engine.pwrite(torch.zeros(4), tmp_path / "n", -1)
    assert not (tmp_path / "n").exists()


@pytest.mark.parametrize("kind", ENGINES)
def test_file_close_waits_for_inflight(kind, tmp_path):
    with engine_or_skip(kind, block_size=1 << 16, queue_depth=4) as e:
        f = e.open(tmp_path / "c.bin", create=True)
        src = random_bytes((8 << 20) + 5, seed=11)
        h = e.pwrite(src, f, 0)
        f.close()  # must not pull the descriptor from under the transfer
        assert h.wait() == src.numel()
        with pytest.raises(ValueError, match="closed"):
            e.pread(torch.empty(1, dtype=torch.uint8), f, 0)
    assert open(tmp_path / "c.bin", "rb").read() == bytes(src.numpy())
