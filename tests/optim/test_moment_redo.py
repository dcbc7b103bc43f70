"""Note [Redo from moments]: the gradient a transactional step used is recovered from the
committed and the speculative first moment (homes cpu and nvme, several tiles, per-segment
beta1 overrides, the first step whose committed moments are zero), and ``rollback_key``
rolls back one partition of a transaction only.  References: the gradients themselves and
the store's own state before the step."""
import os

import pytest
import torch

from infinity.io import AioEngine, SwapSpace
from infinity.optim.moment_redo import recover_grad
from infinity.optim.offload_step import OptimizerStateStore, StepItem, StepTxn

TILE = 2048
B1, B2, EPS = 0.9, 0.999, 1e-8


@pytest.fixture
def swap(swap_dir):
    eng = AioEngine(block_size=1 << 20, queue_depth=32, threads=1, engine="auto")
    sp = SwapSpace([swap_dir], eng)
    yield sp
    sp.close()
    eng.close()
    left = [f for _, _, fs in os.walk(swap_dir) for f in fs] if os.path.exists(swap_dir) else []
    assert left == []


def _step(st, key, n, grad, step, txn=None, segs=None):
    segs = segs or [(0, n, 1e-2, 0.01)]
    if txn is not None:
        st.prepare(txn, key)
    st.step([StepItem(key, grad, segs)], step=step, beta1=B1, beta2=B2, eps=EPS, txn=txn)


def _state(st, key, n):
    out = [torch.empty(n) for _ in range(3)]
    st.read_master(key, out[0])
    st.read_state(key, "exp_avg", out[1])
    st.read_state(key, "exp_avg_sq", out[2])
    return out


@pytest.mark.parametrize("home", ["cpu", "nvme"])
@pytest.mark.parametrize("first", [True, False], ids=["first-step", "later-step"])
def test_recovered_gradient_is_the_one_stepped(swap, home, first):
    n = 3 * TILE + 517
    g = torch.Generator().manual_seed(0)
    init = torch.randn(n, generator=g)
    # per-segment beta1 override in the middle (a param group with its own betas)
    segs = [(0, 1000, 1e-2, 0.01), (1000, 3000, 1e-2, 0.0, (0.8, 0.99, 1e-8)),
            (4000, n - 4000, 1e-2, 0.01)]
    with OptimizerStateStore(home, swap=swap, tile_numel=TILE) as st:
        st.add("p", n, init=init)
        step = 1
        if not first:                       # committed moments that are not zero
            for _ in range(3):
                _step(st, "p", n, torch.randn(n, generator=g), step, segs=segs)
                step += 1
        grad = torch.randn(n, generator=g) * 0.1
        txn = StepTxn()
        _step(st, "p", n, grad, step, txn=txn, segs=segs)
        out = torch.empty(n)
        recover_grad(st, txn, "p", segs, B1, out)
        st.rollback(txn)
    err = (out - grad).abs()
    # fp32 rounding of m' - b1*m, divided by 1 - b1 (10x for 0.9, 5x for the 0.8 segment)
    assert float(err.max()) < 1e-5, float(err.max())
    assert float((out - grad).norm() / grad.norm()) < 1e-6


@pytest.mark.parametrize("home", ["cpu", "nvme"])
def test_rollback_key_leaves_the_other_partitions_of_the_transaction(swap, home):
    n = TILE + 100
    g = torch.Generator().manual_seed(1)
    with OptimizerStateStore(home, swap=swap, tile_numel=TILE) as st:
        for k in ("a", "b"):
            st.add(k, n, init=torch.randn(n, generator=g))
            _step(st, k, n, torch.randn(n, generator=g), 1)
        before = {k: _state(st, k, n) for k in ("a", "b")}
        txn = StepTxn()
        ga, gb = torch.randn(n, generator=g), torch.randn(n, generator=g)
        _step(st, "a", n, ga, 2, txn=txn)
        _step(st, "b", n, gb, 2, txn=txn)
        st.rollback_key(txn, "a")
        assert txn.keys == {"b"}
        _step(st, "a", n, ga * 0.5, 2, txn=txn)     # redone with a clipped gradient
        st.commit(txn)
        after = {k: _state(st, k, n) for k in ("a", "b")}
    with OptimizerStateStore(home, swap=swap, tile_numel=TILE) as ref:
        for k, gr in (("a", ga * 0.5), ("b", gb)):
            ref.add(k, n, init=before[k][0])
            ref.write_state(k, "exp_avg", before[k][1])
            ref.write_state(k, "exp_avg_sq", before[k][2])
            _step(ref, k, n, gr, 2)
            want = _state(ref, k, n)
            for got, w in zip(after[k], want):
                assert torch.equal(got, w), k


def test_bf16_moments_are_refused(swap):
    n = 64
    with OptimizerStateStore("cpu", swap=swap, tile_numel=TILE,
                             state_dtype=torch.bfloat16) as st:
        st.add("p", n, init=torch.zeros(n))
        txn = StepTxn()
        _step(st, "p", n, torch.ones(n), 1, txn=txn)
        with pytest.raises(RuntimeError, match="fp32 moments only"):
            recover_grad(st, txn, "p", [(0, n, 1e-2, 0.0)], B1, torch.empty(n))
        st.rollback(txn)
