"""SwapSpace tells an accounting object of every extent, so NVMe bytes and peaks are exact."""
from infinity.io import AioEngine, SwapSpace
from infinity.memory.accounting import Accounting


def test_nvme_tier_bytes_follow_allocations(tmp_path):
    acct = Accounting()
    with AioEngine(engine="posix") as eng:
        sp = SwapSpace([str(tmp_path / "a")], eng, accounting=acct)
        try:
            a = sp.allocate(5000)
            b = sp.allocate(1 << 20)
            d = acct.as_dict()
            assert d["nvme_bytes"] == sp.bytes_allocated == a.span + b.span
            sp.free(a)
            d = acct.as_dict()
            assert d["nvme_bytes"] == sp.bytes_allocated == b.span
            assert d["nvme_peak_bytes"] == a.span + b.span
        finally:
            sp.close()
