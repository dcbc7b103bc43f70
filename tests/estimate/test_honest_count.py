"""The honest count (issue 32): MFU on the model-FLOPs basis, the planner's headroom,
derating and clipping, drive wear, and the terms every step pays -- attention FLOPs, tiled
layers re-read for the recompute, offloaded activations over PCIe, GPUs sharing a PCIe
link, host memory bandwidth, the optimizer overlapped with the last backward -- and the
ZeRO device gradient line equal to the engine's own placement plan."""
import dataclasses
import os
import sys

import pytest

from infinity.estimate import Machine, estimate, spec_from_dims
from infinity.estimate.memory_plan import Knobs
from infinity.estimate.planner import make_plan
from infinity.estimate.step_time import model_flops_per_token

GB = 10**9
NODE = dict(gpus=8, gpu_mem_gb=80, host_mem_gb=2000, nvme_gb=30000, nvme_drives=8,
            nvme_gbps=56, nvme_write_gbps=40, tflops=400)


def _spec(params=20_000_000_000, layers=44, hidden=6144):
    return spec_from_dims(params, layers, hidden, vocab=50000, seq=2048)


def test_mfu_counts_model_flops_and_hfu_the_recompute():
    spec = _spec()
    assert model_flops_per_token(spec) == 6 * spec.params + 12 * 44 * 6144 * 2048
    assert model_flops_per_token(spec, checkpointing=True, hardware=True) == \
        8 * spec.params + 16 * 44 * 6144 * 2048
    m = Machine(gpus=2, gpu_mem_gb=24, host_mem_gb=256, nvme_gb=2000, nvme_drives=2,
                nvme_gbps=12, nvme_write_gbps=8, tflops=100)
    p = make_plan(spec, m, Knobs(), global_batch=16)
    tps = p.best.step.tokens_per_s
    assert p.mfu() == pytest.approx(tps * model_flops_per_token(spec) / (2 * 100e12))
    if p.best.checkpointing:
        assert p.hfu() > p.mfu()
    assert p.headline().startswith(f"Plan: MFU {100 * p.mfu():.1f} %")


def test_the_planner_keeps_headroom_derates_drives_and_clips():
    spec = _spec()
    m = Machine(**NODE)
    p = make_plan(spec, m, Knobs(), global_batch=128)
    pm = p.machine
    assert pm.nvme_gb == pytest.approx(0.9 * 30000) and pm.host_mem_gb == pytest.approx(1800)
    assert pm.nvme_gbps == pytest.approx(0.8 * 56) and pm.nvme_write_gbps == pytest.approx(32)
    assert p.best.knobs.gradient_clipping == 1.0 and p.best.config()["gradient_clipping"] == 1.0
    assert p.nvme_used_fraction() <= 0.9
    d = p.as_dict()
    assert {"mfu", "hardware_flops_utilization", "nvme_used_fraction", "nvme_derate",
            "gradient_clipping", "drive_tb_written_per_step"} <= set(d)
    # no clipping asked for: none; the config's own clipping is kept
    assert make_plan(spec, m, Knobs(), global_batch=128, clip=0).best.knobs.gradient_clipping == 0
    k = Knobs(gradient_clipping=0.3)
    assert make_plan(spec, m, k, global_batch=128).best.knobs.gradient_clipping == 0.3
    # drives measured here (bench-io): not derated
    meas = Machine(**NODE, sources={"nvme_gbps": "measured: --bench-io"})
    assert make_plan(spec, meas, Knobs(), global_batch=128).machine.nvme_gbps == 56
    with pytest.raises(Exception, match="nvme_headroom"):
        make_plan(spec, m, Knobs(), global_batch=128, nvme_headroom=1.5)


def test_drive_wear_per_step_and_life():
    spec = _spec()
    p = make_plan(spec, Machine(**NODE), Knobs(), global_batch=128, drive_tbw=7000)
    w = p.wear()
    tb = p.best.step.traffic["nvme_write"] / 1e12
    assert w["tb_written_per_step"] == pytest.approx(tb)
    assert w["tb_written_per_million_tokens"] == pytest.approx(tb * 1e6 / (128 * 2048))
    if tb:
        assert w["drive_life_steps"] == pytest.approx(7000 / tb)
    assert "drive wear:" in p.text()


def _step(machine, **kw):
    spec = _spec(params=10**12, layers=128, hidden=25600)
    kw.setdefault("tiling_max_group_gb", 1.31)
    est = estimate(params=spec.params, layers=128, hidden=25600, vocab=50000, seq=2048,
                   machine=machine, precision="bf16", configs=[("nvme", "nvme")], **kw)
    return est.configs[0]


def test_tiled_layers_keep_their_tiles_from_the_recompute():
    """Note [Recompute keeps its tiles]: the recompute's tiles are kept in host memory for the
    backward (a line of the plan: one layer's tiled weights per rank), so checkpointing adds
    no read of the tiled groups; without that line they are read a third time."""
    import dataclasses as dc
    from infinity.estimate.step_time import estimate_step
    est = estimate(params=10**12, layers=128, hidden=25600, vocab=50000, seq=2048,
                   machine=Machine(**NODE), precision="bf16", configs=[("nvme", "nvme")],
                   tiling_max_group_gb=1.31)
    c = est.configs[0]
    ck, no = c.steps["checkpointing"], c.steps["none"]
    assert ck.traffic["nvme_read"] == no.traffic["nvme_read"]
    kept = {i.name: i.nbytes for i in c.plan.items}["tiles kept from the recompute for the backward"]
    assert 0 < kept < 8 * 2 * 10**12 / 128 * 1.1     # a layer's tiled weights per rank
    again = estimate_step(est.model, est.machine, est.knobs, dc.replace(c.plan, tiles_kept=False),
                          checkpointing=True)
    assert again.traffic["nvme_read"] > ck.traffic["nvme_read"]
    assert any("re-read for recompute" in line for line in again.fwd_bwd.derivation)


def test_offloaded_activations_cross_pcie_and_links_are_shared():
    m = Machine(**NODE)
    base = _step(m).steps["checkpointing"]
    off = _step(m, activation_home="cpu").steps["checkpointing"]
    assert off.traffic["d2h"] > base.traffic["d2h"] and off.traffic["h2d"] > base.traffic["h2d"]
    assert m.pcie_share == 2 and Machine(**{**NODE, "gpus": 4}).pcie_share == 1
    one = _step(dataclasses.replace(m, gpus_per_pcie_link=1)).steps["checkpointing"]
    assert base.fwd_bwd.terms["pcie"] == pytest.approx(2 * one.fwd_bwd.terms["pcie"])
    assert base.fwd_bwd.terms["host_memory"] > 0 and base.optimizer.terms["host_memory"] > 0
    cpu = Machine(gpus=0, host_mem_gb=64, nvme_gb=1000)
    assert "host_memory" not in _step(cpu).steps["none"].fwd_bwd.terms or \
        _step(cpu).steps["none"].fwd_bwd.terms["host_memory"] == 0


def test_the_optimizer_overlaps_the_last_backward_on_gpu_nodes():
    spec = _spec(params=7_000_000_000, layers=32, hidden=4096)
    m = Machine(gpus=1, gpu_mem_gb=80, host_mem_gb=512, nvme_gb=4000, tflops=300)
    # (params resident: a compute-bound backward the optimizer's NVMe pass hides under)
    est = estimate(params=spec.params, layers=32, hidden=4096, seq=2048, machine=m,
                   precision="bf16", grad_accum=4, configs=[("none", "nvme")])
    s = est.configs[0].steps["checkpointing"]
    assert s.last_s is not None
    assert s.step_s == pytest.approx(3 * s.fwd_bwd.seconds + s.last_s)
    assert s.step_s < 4 * s.fwd_bwd.seconds + s.optimizer.seconds
    # fp16 (the loss scale's global overflow check) and ZeRO stage 1-2 do not overlap
    est16 = estimate(params=spec.params, layers=32, hidden=4096, seq=2048, machine=m,
                     precision="fp16", grad_accum=4, configs=[("none", "nvme")])
    assert est16.configs[0].steps["checkpointing"].last_s is None


@pytest.mark.parametrize("bucket_mb", [None, 0.5, 0])
def test_zero_device_gradient_line_is_the_engines(tmp_path, monkeypatch, bucket_mb):
    """Stage 3 on 2 simulated-device ranks: the estimator's device gradient line equals the
    engine's own placement plan's: buckets (the default 128 MB, larger than a shard here;
    0.5 MB, half of one) or whole groups (``reduce_bucket_mb: 0``: full fp32 buffers of the
    groups being reduced)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.join(os.path.dirname(here), "zero"))
    sys.path.insert(0, here)
    from zero_harness import run_ranks_ok
    monkeypatch.setenv("INFINITY_SIMULATE_DEVICE", "1")
    d, layers = 1024, 3
    cfg = {"precision": "bf16", "zero_stage": 3,
           "offload": {"params": "cpu", "optimizer": "cpu", "nvme_paths": [str(tmp_path / "s")]}}
    knobs = {}
    if bucket_mb is not None:
        cfg["reduce_bucket_mb"] = knobs["reduce_bucket_mb"] = bucket_mb
    res = run_ranks_ok("placement_child.py", {"config": cfg, "d": d, "layers": layers}, tmp_path,
                       timeout=180)
    from infinity.estimate import spec_from_module
    import torch
    from test_device_line_vs_engine import Stack       # (the model the child builds)
    with torch.device("meta"):
        model = Stack(d, layers)
    spec = spec_from_module(model, seq=1, hidden=d, heads=1)
    from infinity.estimate.memory_plan import plan_memory
    pl = plan_memory(spec, Machine(gpus=2, gpu_mem_gb=1, host_mem_gb=64, nvme_gb=10),
                     Knobs(precision="bf16", zero_stage=3, **knobs), "cpu", "cpu")
    est = {i.name: i.nbytes for i in pl.items if i.tier == "device"}
    line = "gradients awaiting reduce-scatter" if bucket_mb == 0 else "gradient buckets"
    for r in res:
        assert r.result["separate"]
        eng = next(v for k, v in r.result["device"].items() if k.startswith(line))
        assert eng == pytest.approx(est["grads of groups in backward"], rel=0.02)
