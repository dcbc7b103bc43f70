"""Many requests in flight at once, waited individually, incl. neighbours sharing a block."""
import os
import random
import sys
import threading

import pytest
import torch

from infinity.io import aligned_empty

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iotest_helpers import ENGINES, engine_or_skip, random_bytes  # noqa: E402


@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("threads", [1, 3])
def test_neighbours_sharing_unaligned_blocks(kind, threads, tmp_path):
    """Writes of 100..700-byte pieces back to back: most 512/4096-byte blocks are shared by 2+ requests
    whose read-modify-write must not lose each other's bytes."""
    rng = random.Random(threads)
    sizes = [rng.randint(1, 700) for _ in range(400)]
    total = sum(sizes)
    data = random_bytes(total, seed=threads)
    with engine_or_skip(kind, block_size=1 << 16, queue_depth=16, threads=threads) as e:
        f = e.open(tmp_path / "n.bin", create=True)
        handles, off = [], 0
        for n in sizes:
            handles.append(e.pwrite(data[off:off + n].clone(), f, off))  # clones die before completion
            off += n
        order = list(range(len(handles)))
        rng.shuffle(order)
        for i in order:
            assert handles[i].wait() == sizes[i]
        back = torch.zeros(total, dtype=torch.uint8)
        assert e.pread(back, f, 0).wait() == total
        assert torch.equal(back, data)
        # and concurrent reads of the same pieces
        outs, hs, off = [], [], 0
        for n in sizes:
            o = torch.empty(n, dtype=torch.uint8)
            outs.append((o, off, n))
            hs.append(e.pread(o, f, off))
            off += n
        for h in reversed(hs):
            h.wait()
        for o, off, n in outs:
            assert torch.equal(o, data[off:off + n])
    assert os.path.getsize(tmp_path / "n.bin") == total


@pytest.mark.parametrize("kind", ENGINES)
def test_many_handles_done_and_wait(kind, tmp_path):
    with engine_or_skip(kind, block_size=1 << 16, queue_depth=32, threads=2) as e:
        f = e.open(tmp_path / "m.bin", create=True)
        piece = 1 << 16
        bufs = [aligned_empty(piece) for _ in range(64)]
        for i, b in enumerate(bufs):
            b.fill_(i)
        hs = [e.pwrite(b, f, i * piece) for i, b in enumerate(bufs)]
        assert all(h.wait() == piece for h in hs)
        assert all(h.done() for h in hs)
        assert hs[0].wait() == piece  # wait() is idempotent
        outs = [aligned_empty(piece) for _ in range(64)]
        hs = [e.pread(o, f, i * piece) for i, o in enumerate(outs)]
        for i in range(63, -1, -1):
            hs[i].wait()
            assert bool((outs[i] == i).all()), i


@pytest.mark.parametrize("kind", ENGINES)
def test_submit_from_several_python_threads(kind, tmp_path):
    with engine_or_skip(kind, block_size=1 << 16, queue_depth=8, threads=2) as e:
        f = e.open(tmp_path / "t.bin", create=True)
        data = random_bytes(8 * 300_001, seed=9)
        errors = []

        def worker(k):
            try:
                for j in range(3):
                    lo = (k * 3 + j) * 100_000 + k
                    seg = data[lo:lo + 100_000]
                    e.pwrite(seg, f, lo).wait()
                    back = torch.empty_like(seg)
                    e.pread(back, f, lo).wait()
                    if not torch.equal(back, seg):
                        errors.append((k, j))
            except Exception as ex:  # surfaced below
                errors.append(ex)

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors


def test_handle_keeps_tensor_alive(tmp_path):
    """Dropping the caller's reference before completion must not corrupt the transfer."""
    import gc
    with engine_or_skip("posix", block_size=1 << 16, queue_depth=4) as e:
        expect = random_bytes(3 << 20, seed=5)
        h = e.pwrite(expect.clone(), tmp_path / "k.bin", 0)
        gc.collect()
        torch.randn(3 << 18)  # churn the allocator
        h.wait()
        back = torch.empty_like(expect)
        e.pread(back, tmp_path / "k.bin", 0).wait()
        assert torch.equal(back, expect)
