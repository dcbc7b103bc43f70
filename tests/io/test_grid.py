"""Round-trip grid: sizes x offsets x block sizes x queue depths x engines x threads.

The default suite runs a representative diagonal; the full product is `slow`.
"""
import itertools
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from iotest_helpers import ENGINES, engine_or_skip, random_bytes  # noqa: E402

SIZES = [1, 7, 4095, 4096, 4097, (1 << 20) - 1, (1 << 20) + 1, (64 << 20) + 3]
OFFSETS = [0, 3, 4096, (1 << 20) + 511]
BLOCKS = [4096, 1 << 16, 1 << 20]
QDS = [1, 4, 32]
THREADS = [1, 2]


def _roundtrip(kind, size, offset, block, qd, threads, tmp_path, unaligned_buffer=False):
    with engine_or_skip(kind, block_size=block, queue_depth=qd, threads=threads) as e:
        src = random_bytes(size + 1, seed=size ^ offset)
        src = src[1:] if unaligned_buffer else src[:size]
        path = tmp_path / f"g{size}_{offset}"
        assert e.pwrite(src, path, offset).wait() == size
        dst = torch.zeros(size + 1, dtype=torch.uint8)
        dst = dst[1:] if unaligned_buffer else dst[:size]
        assert e.pread(dst, path, offset).wait() == size
        assert torch.equal(dst, src)
        assert os.path.getsize(path) == offset + size
        path.unlink()


# Default: every size and every engine, with the other parameters rotated.
DIAGONAL = [(kind, size, OFFSETS[i % len(OFFSETS)], BLOCKS[i % len(BLOCKS)], QDS[(i + 1) % len(QDS)],
             THREADS[i % 2], bool(i % 3 == 1))
            for kind in ENGINES for i, size in enumerate(SIZES[:-1])]


@pytest.mark.parametrize("kind,size,offset,block,qd,threads,unaligned", DIAGONAL)
def test_grid_diagonal(kind, size, offset, block, qd, threads, unaligned, tmp_path):
    _roundtrip(kind, size, offset, block, qd, threads, tmp_path, unaligned)


@pytest.mark.parametrize("kind", ENGINES)
def test_64mib_plus_3(kind, tmp_path):
    _roundtrip(kind, (64 << 20) + 3, 4096 + 5, 1 << 20, 32, 1, tmp_path)


FULL = list(itertools.product(ENGINES, SIZES[:-1], OFFSETS, BLOCKS, QDS, THREADS))


@pytest.mark.slow
@pytest.mark.parametrize("kind,size,offset,block,qd,threads", FULL)
def test_grid_full(kind, size, offset, block, qd, threads, tmp_path):
    _roundtrip(kind, size, offset, block, qd, threads, tmp_path, unaligned_buffer=(size + offset) % 2 == 1)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ENGINES)
@pytest.mark.parametrize("offset", OFFSETS)
def test_64mib_plus_3_offsets(kind, offset, tmp_path):
    _roundtrip(kind, (64 << 20) + 3, offset, 1 << 20, 32, 2, tmp_path, unaligned_buffer=True)
