import pytest
import torch

from infinity.memory.accounting import Accounting
from infinity.memory.pool import BufferPool, PoolExhausted


def test_lease_reuse_budget_and_accounting():
    acct = Accounting()
    pool = BufferPool("host", 3 * 8192, acct)
    a = pool.lease(5000, torch.float32)       # rounds to 8192 bytes
    assert a.numel() == 1250 and a.data_ptr() % 4096 == 0
    b = pool.lease(8192, torch.bfloat16)
    assert acct.current["host"] == 16384
    pool.give_back(a)
    c = pool.lease(8000, torch.float32)       # same size class: reused, no new bytes
    assert c.data_ptr() == a.data_ptr() and acct.current["host"] == 16384
    pool.lease(8192, torch.uint8)
    with pytest.raises(PoolExhausted, match="budget 24576"):
        pool.lease(4096, torch.uint8)
    pool.give_back(b)
    pool.give_back(c)
    pool.trim()
    assert acct.current["host"] == 8192 and acct.peak["host"] == 24576
    pool.close()


def test_double_return_and_foreign_buffers_are_refused():
    acct = Accounting()
    pool = BufferPool("host", 1 << 20, acct)
    a = pool.lease(8192, torch.float32)
    b = pool.lease(8192, torch.float32)
    assert pool.is_leased(a)
    pool.give_back(a)
    assert not pool.is_leased(a)
    with pytest.raises(ValueError, match="not on lease from this pool"):
        pool.give_back(a)                      # twice: would let two owners share memory
    assert pool.leased == 8192
    c = pool.lease(8192, torch.float32)        # the returned buffer is reused exactly once
    assert c.data_ptr() == a.data_ptr()
    d = pool.lease(8192, torch.float32)
    assert d.data_ptr() not in (b.data_ptr(), c.data_ptr())
    with pytest.raises(ValueError, match="not on lease"):
        pool.give_back(torch.empty(2048))      # never leased here
    with pytest.raises(ValueError, match="view"):
        pool.give_back(b[:10])                 # a smaller view of a leased buffer
    with pytest.raises(ValueError, match="not on lease"):
        pool.detach(torch.empty(2048))
    other = BufferPool("device", 1 << 20, acct)
    with pytest.raises(ValueError, match="not on lease"):
        other.give_back(b)                     # leased from another pool
    for t in (b, c, d):
        pool.give_back(t)
    assert pool.leased == 0


def test_scoped_lease_is_returned_however_the_block_ends_and_one_reclaimer():
    pool = BufferPool("host", 1 << 20, Accounting())
    with pool.scoped(8192, torch.float32) as buf:
        assert pool.is_leased(buf) and pool.leased == 8192
    assert pool.leased == 0
    with pytest.raises(RuntimeError, match="boom"):
        with pool.scoped(4096, torch.uint8) as buf:
            raise RuntimeError("boom")
    assert pool.leased == 0 and not pool.is_leased(buf)
    first = lambda n: None  # noqa: E731
    pool.set_reclaimer(first)
    with pytest.raises(RuntimeError, match="already attached"):
        pool.set_reclaimer(lambda n: None)
    pool.set_reclaimer(None)
    pool.set_reclaimer(first)
