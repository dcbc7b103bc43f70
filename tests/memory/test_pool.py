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
