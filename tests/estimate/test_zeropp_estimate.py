"""The estimator's ZeRO++ model (step_time.collective_traffic, the hpZ memory item) against
the formulas of docs/zero.md worked by hand, on 4 nodes x 8 GPUs."""
import pytest

import infinity
from infinity.zero.zeropp import GRAD_BLOCK, WEIGHT_BLOCK

N = 7_000_000_000
MACHINE = dict(gpus=8, nodes=4, gpu_mem_gb=80, host_mem_gb=1000, nvme_gb=4000,
               inter_node_gbps=12.5)


def run(zpp, **machine):
    e = infinity.estimate(params=N, layers=32, hidden=4096, vocab=32000,
                          machine={**MACHINE, **machine},
                          config={"precision": "bf16", "zero_pp": zpp})
    c = next(c for c in e.configs if c.params_home == "none" and c.optimizer_home == "cpu")
    return c, c.steps["checkpointing"]


def test_traffic_matches_the_formulas():
    R, r, nodes, lp = 32, 8, 4, 2
    _, base = run({})
    t = base.traffic
    assert t["allgather"] == pytest.approx(2 * N * lp * (R - 1) / R, rel=1e-6)
    assert t["inter_node"] == pytest.approx(2 * N * lp * (R - r) / R + N * lp * (R - r) / R,
                                            rel=1e-6)
    _, qw = run({"quantized_weights": True})
    w = 1 + 4 / WEIGHT_BLOCK
    assert qw.traffic["allgather"] == pytest.approx(2 * N * w * (R - 1) / R, rel=1e-6)
    assert qw.traffic["allgather"] <= 0.55 * t["allgather"]
    _, hpz = run({"hpz_partition_size": 8})
    assert hpz.traffic["allgather"] == pytest.approx(
        N * lp * (R - 1) / R + N * lp * 7 / 8, rel=1e-6)
    assert hpz.traffic["inter_node"] == pytest.approx(
        N * lp * (R - r) / R + N * lp * (R - r) / R, rel=1e-6)      # fwd + grads only
    _, qg = run({"quantized_gradients": True})
    g = 0.5 + 4 / GRAD_BLOCK
    assert qg.traffic["reduce_scatter"] == pytest.approx(
        N * g * (r - 1) / r + N * g * (nodes - 1) / R, rel=1e-6)
    grads_inter = qg.traffic["inter_node"] - (t["inter_node"] - N * lp * (R - r) / R)
    assert grads_inter == pytest.approx(N * g * (nodes - 1) / R, rel=1e-6)


def test_step_time_and_memory():
    c0, base = run({})
    c1, all3 = run({"quantized_weights": True, "hpz_partition_size": 8,
                    "quantized_gradients": True})
    assert base.bound == "collectives" and all3.step_s < 0.6 * base.step_s
    hp = [i for i in c1.plan.items if i.name.startswith("hpZ secondary")]
    assert len(hp) == 1 and hp[0].tier == "device" and hp[0].nbytes == -(-N // 8) * 2
    # qgZ quantizes whole groups: their fp32 reduce buffers replace the gradient buckets
    grads = [next(i.nbytes for i in c.plan.items if i.name == "grads of groups in backward")
             for c in (c0, c1)]
    assert c1.totals["device_checkpointing"] - c0.totals["device_checkpointing"] \
        == hp[0].nbytes + grads[1] - grads[0]
    # a fast inter-node link: the same bytes, collectives no longer the bound
    _, fast = run({}, inter_node_gbps=100)
    assert fast.traffic == base.traffic and fast.step_s < base.step_s


def test_inter_node_defaults_to_interconnect():
    a = infinity.estimate(params=N, layers=32, hidden=4096, vocab=32000,
                          machine=dict(gpus=8, nodes=2, gpu_mem_gb=80, host_mem_gb=1000,
                                       nvme_gb=4000, interconnect_gbps=50),
                          config={"precision": "bf16"})
    assert a.machine.inter_node_gbps == 50


def test_reuse_of_forward_gathers_takes_its_fraction_off_backward():
    """prefetch.reuse_gb (Note [Reuse within a micro-step]): backward gathers (and reads
    from NVMe) only the fraction k = reuse / (N*lp) that was not kept; on a GPU the
    automatic setting is not counted (k = 0, the formulas above)."""
    R, lp = 32, 2
    kept = 0.25 * N * lp
    e = infinity.estimate(params=N, layers=32, hidden=4096, vocab=32000, machine=MACHINE,
                          config={"precision": "bf16", "prefetch": {"reuse_gb": kept / 1e9}})
    c = next(c for c in e.configs if c.params_home == "nvme" and c.optimizer_home == "cpu")
    e0 = infinity.estimate(params=N, layers=32, hidden=4096, vocab=32000, machine=MACHINE,
                           config={"precision": "bf16"})
    c0 = next(c for c in e0.configs if c.params_home == "nvme" and c.optimizer_home == "cpu")
    t, t0 = c.steps["checkpointing"].traffic, c0.steps["checkpointing"].traffic
    assert t0["allgather"] == pytest.approx(2 * N * lp * (R - 1) / R, rel=1e-6)
    assert t["allgather"] == pytest.approx(1.75 * N * lp * (R - 1) / R, rel=1e-6)
    # NVMe per node: its 8 of the 32 ranks' shards, k of them not read again
    assert t["nvme_read"] == pytest.approx(t0["nvme_read"] - 0.25 * N * lp / 4, rel=1e-6)
    assert any(i.name.startswith("groups kept for reuse") and i.nbytes == int(kept)
               for i in c.plan.items)
