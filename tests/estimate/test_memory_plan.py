"""Hand-computed tier lines, fits and traffic on small models (numbers derived in comments)."""
import pytest

import infinity
from infinity.estimate import EstimateError, Machine, ModelSpec, estimate, spec_from_dims
from infinity.estimate.memory_plan import Knobs, plan_memory, valid_configs

GB = 10**9


def small_spec():
    return ModelSpec(params=1_000_000, layers=4, hidden=64, seq=16, batch=2, vocab=None, heads=2,
                     largest_group={"module": 50_000, "block": 250_000}, groups={"module": 20, "block": 4})


def items(plan):
    return {(i.tier, i.name): i.nbytes for i in plan.items}


def test_spec_from_dims_shape_model():
    s = spec_from_dims(10_000, 2, 8, vocab=100, seq=4, batch=1)
    # embedding 100*8 = 800; per block (10000-800)/2 = 4600; MLP matrix 4*64+4*8 = 288
    assert s.largest_group == {"module": 800, "block": 4600}
    s = spec_from_dims(10_000, 2, 8)
    assert s.largest_group == {"module": 288, "block": 5000}
    with pytest.raises(EstimateError, match="vocab\\*hidden"):
        spec_from_dims(100, 2, 8, vocab=100)
    with pytest.raises(EstimateError, match="positive integer"):
        spec_from_dims(0, 2, 8)


def test_nvme_nvme_two_gpus_every_line():
    # RAM large enough that the engine keeps the fp32 grads in host memory
    m = Machine(gpus=2, gpu_mem_gb=1, host_mem_gb=100, nvme_gb=1, gpu_reserve_gb=0)
    k = Knobs(precision="bf16", zero_stage=3, prefetch_depth=2, tile_numel=1000, pipeline_depth=3,
              aio_queue_depth=2, aio_block_size=4096)
    pl = plan_memory(small_spec(), m, k, "nvme", "nvme")
    # N=1e6, R=r=2, lp=2, sb=4, Gmax=50000, d=2 (window d+2), shard=500000
    assert items(pl) == {
        ("device", "fetched groups (in use + prefetch)"): (2 + 2) * 50_000 * 2,
        # as the engine reserves: 4 + 3 gradient buckets of at most a shard, bf16
        ("device", "grads of groups in backward"): 7 * 25_000 * 2,
        ("pinned", "NVMe->GPU staging (prefetch window)"): 2 * (2 + 2) * 25_000 * 2,
        ("pinned", "GPU->host grad staging"): 2 * 4 * 25_000 * 2,
        ("pinned", "optimizer tile ring"): 2 * 3 * 1000 * (4 + 4 + 4 + 4 + 2),
        ("pageable", "grad accumulation (fp32, host)"): 2 * 500_000 * 4,
        ("nvme", "param home (NVMe)"): 2 * 500_000 * 2,
        ("nvme", "optimizer: master + m + v (NVMe)"): 2 * 500_000 * 12,
        ("nvme", "commit shadows (all-or-nothing updates)"): 2 * 500_000 * 12,
    }
    # Korthikanti et al.: per layer S*B*H*(34 + 5*a*S/H) = 16*2*64*(34 + 5*2*16/64) = 74752
    assert pl.activations["none"].nbytes == 4 * 74_752
    assert pl.activations["checkpointing"].nbytes == 4 * 2 * 16 * 2 * 64 + 74_752


def test_device_homes_stage3_and_stage1():
    m = Machine(gpus=2, gpu_mem_gb=1, host_mem_gb=1, nvme_gb=1)
    pl = plan_memory(small_spec(), m, Knobs(precision="bf16"), "none", "none")
    # offload.optimizer "none": the engine's optimizer is CPU Adam whatever the home, so
    # gradients leave the device and the states (master + m + v) are in host memory, as
    # with "cpu" (infinity/memory/plan.py counts them there too)
    assert items(pl) == {
        ("device", "param shard"): 500_000 * 2,
        ("device", "gathered groups (all-gather window)"): 4 * 50_000 * 2,
        ("device", "grads of groups in backward"): 7 * 25_000 * 2,
        ("pinned", "GPU->host grad staging"): 2 * 4 * 25_000 * 2,
        ("pageable", "grad accumulation (fp32, host)"): 2 * 500_000 * 4,
        ("pageable", "optimizer: master + m + v (host)"): 2 * 500_000 * 12,
    }
    pl1 = plan_memory(small_spec(), m, Knobs(precision="bf16", zero_stage=1), "none", "cpu")
    it = items(pl1)
    assert it[("device", "params")] == 1_000_000 * 2          # replicated below stage 3
    assert it[("pinned", "GPU->host grad staging")] == 2 * 2 * 50_000 * 2   # no reduce-scatter
    assert it[("pageable", "optimizer: master + m + v (host)")] == 2 * 500_000 * 12


def test_fp32_param_is_master_stored_once_cpu_only():
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=1)   # RAM enough to keep grads on the host
    pl = plan_memory(small_spec(), m, Knobs(precision="fp32", tile_numel=1000), "cpu", "cpu")
    # CPU-only: the host home is used in place (no device copy); the fp32 param is the
    # master, so the optimizer keeps only m and v; no swap space -> no tile ring
    # the step overlaps backward (one CPU process, no clipping): an update is
    # all-or-nothing, so the host states it updates in place (master, m, v) get undo copies
    assert items(pl) == {
        ("pinned", "param home (host)"): 1_000_000 * 4,
        ("pageable", "grad accumulation (fp32, host)"): 1_000_000 * 4,
        ("pageable", "optimizer: m + v (host)"): 1_000_000 * 8,
        ("pageable", "commit undo copies (host states, per update)"): 1_000_000 * 12,
    }
    assert pl.master_is_param and any("master" in n for n in pl.notes)
    # bf16, params on NVMe, optimizer on the host: fp32 master + m + v on the host, the
    # ring carries master + grad tiles (swap in use) and the bf16 param output
    pl = plan_memory(small_spec(), m, Knobs(precision="bf16", tile_numel=1000), "nvme", "cpu")
    assert items(pl) == {
        ("device", "fetched groups (in use + prefetch)"): 4 * 50_000 * 2,
        ("nvme", "param home (NVMe)"): 1_000_000 * 2,
        ("pinned", "NVMe staging (initialisation only)"): 50_000 * 2,
        ("pageable", "grad accumulation (fp32, host)"): 1_000_000 * 4,
        ("pageable", "optimizer: master + m + v (host)"): 1_000_000 * 12,
        ("pinned", "optimizer tile ring"): 3 * 1000 * (8 + 2),
        ("pageable", "commit undo copies (host states, per update)"): 1_000_000 * 12,
    }


def test_grads_spill_to_nvme_when_host_cap_is_small():
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100)
    big = Knobs(precision="bf16", tile_numel=1000)
    assert not plan_memory(small_spec(), m, big, "nvme", "nvme").grads_on_nvme
    # engine rule (one process): host items with grads = staging 50000*2 + grads 4e6
    # + tile ring > 1 MB cap, swap exists -> grads on NVMe
    small = Knobs(precision="bf16", tile_numel=1000, host_cap_gb=0.001)
    pl = plan_memory(small_spec(), m, small, "nvme", "nvme")
    assert pl.grads_on_nvme
    it = items(pl)
    assert it[("nvme", "grad accumulation (fp32, NVMe)")] == 4_000_000
    assert it[("pageable", "grad staging (grads on NVMe)")] == 2 * 50_000 * 4
    assert ("pageable", "grad accumulation (fp32, host)") not in it
    # the engine spills with the optimizer on the host too when params are on NVMe ...
    assert plan_memory(small_spec(), m, small, "nvme", "cpu").grads_on_nvme
    # ... but never without a swap space, nor when told not to
    assert not plan_memory(small_spec(), m, small, "cpu", "cpu").grads_on_nvme
    assert not plan_memory(small_spec(), m, Knobs(precision="bf16", tile_numel=1000, host_cap_gb=0.001,
                                                   grad_spill="off"), "nvme", "nvme").grads_on_nvme
    # "on" forces it whenever a swap space exists
    assert plan_memory(small_spec(), m, Knobs(precision="bf16", tile_numel=1000, grad_spill="on"),
                       "cpu", "nvme").grads_on_nvme
    # the cap just above the host items with grads: no spill; just below: spill. Under a cap
    # the engine's tile is max(65536, min(T, cap*0.15/48)), resident min(tile, Gmax rounded
    # up to 2048 = 51200): ring 3*51200*18
    need = 50_000 * 2 + 4_000_000 + 3 * 51_200 * 18
    assert not plan_memory(small_spec(), m, Knobs(precision="bf16", tile_numel=1000,
                                                  host_cap_gb=(need + 1) / GB), "nvme", "nvme").grads_on_nvme
    assert plan_memory(small_spec(), m, Knobs(precision="bf16", tile_numel=1000,
                                              host_cap_gb=(need - 1) / GB), "nvme", "nvme").grads_on_nvme


def test_zero_rule_across_ranks():
    # R = 2 on one node, stage 3: a rank pages its shard N/R*4 = 2 MB when it exceeds half its
    # share of the host: (host - reserve)/r / 2, reserve = 1 + 1*2 = 3 GB
    spec = small_spec()
    m = Machine(gpus=2, gpu_mem_gb=1, host_mem_gb=3.004, nvme_gb=1)   # share 2 MB, half 1 MB
    k = Knobs(precision="bf16")
    assert plan_memory(spec, m, k, "nvme", "nvme").grads_on_nvme
    assert not plan_memory(spec, m, k, "nvme", "cpu").grads_on_nvme      # optimizer not on NVMe
    assert not plan_memory(spec, Machine(gpus=2, gpu_mem_gb=1, host_mem_gb=3.01, nvme_gb=1), k,
                           "nvme", "nvme").grads_on_nvme                    # half-share 3.5 MB > 2 MB
    assert not plan_memory(spec, m, Knobs(precision="bf16", zero_stage=1), "none", "nvme").grads_on_nvme
    with pytest.raises(EstimateError, match="grad_spill"):
        estimate(spec, machine=m, grad_spill="maybe")


def test_valid_configs():
    assert len(valid_configs(Knobs(zero_stage=3))) == 9
    assert valid_configs(Knobs(zero_stage=2)) == [("none", "none"), ("none", "cpu"), ("none", "nvme")]
    with pytest.raises(EstimateError, match="not valid"):
        estimate(small_spec(), machine=Machine(gpus=0, host_mem_gb=1), zero_stage=1,
                 configs=[("nvme", "nvme")])


def test_fit_boundary_on_device():
    # device with checkpointing: 400000 + 350000 (gradients: 7 bf16 buckets of a 25000-element
    # shard, as the engine reserves) + 91136 = 841136 B; without: 750000 + 299008
    m = Machine(gpus=2, gpu_mem_gb=841_136 / GB, host_mem_gb=10, nvme_gb=1, gpu_reserve_gb=0)
    est = estimate(small_spec(), machine=m, precision="bf16", tile_numel=1000,
                   configs=[("nvme", "nvme")])
    c = est.configs[0]
    assert c.totals["device_checkpointing"] == 841_136 and c.totals["device_none"] == 1_049_008
    assert c.fits == {"checkpointing": True, "none": False}
    assert "device: needs" in c.problems["none"][0]
    m.gpu_mem_gb = 841_135 / GB
    est = estimate(small_spec(), machine=m, precision="bf16", tile_numel=1000, configs=[("nvme", "nvme")])
    assert est.configs[0].fits["checkpointing"] is False and est.best is None
    assert est.verdict().startswith("No:")


def test_traffic_and_step_time_nvme_nvme():
    # CPU-only, R=1, bf16, A=2; NVMe 1 GB/s read, 0.5 GB/s write; Adam 1e-3 G params/s
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100, nvme_gbps=1.0, nvme_write_gbps=0.5,
                tflops=1.0, cpu_adam_gparams=0.001)
    est = estimate(small_spec(), machine=m, precision="bf16", grad_accum=2, configs=[("nvme", "nvme")])
    s = est.configs[0].steps["none"]
    N = 1_000_000
    # params twice per micro-batch + fp32 master, m, v
    assert s.traffic["nvme_read"] == 2 * (2 * N * 2) + N * 12
    assert s.traffic["nvme_write"] == N * 12 + N * 2                # + updated bf16 params
    # fp32 with params on NVMe, optimizer on the host: the master is the NVMe param; the
    # overlapped step takes it from the buffer backward read (master hand-off), with
    # clipping too (speculative early steps hand off the same,
    # tests/engine/test_param_cache.py)
    for clip in (1.0, 0.0):
        e32 = estimate(small_spec(), machine=m, precision="fp32", configs=[("nvme", "cpu")],
                       gradient_clipping=clip)
        t32 = e32.configs[0].steps["none"].traffic
        assert t32["nvme_read"] == 2 * N * 4 and t32["nvme_write"] == N * 4
    assert s.traffic["h2d"] == 0 and s.traffic["allgather"] == 0   # CPU-only, one rank
    attn = 12 * 4 * 64 * 16             # attention FLOPs per token: 12*L*H*S
    t_comp = (6 * N + attn) * 16 * 2 / 1e12
    t_nvme_mb = 4 * N / 1e9
    t_opt = 12 * N / 1e9 + 14 * N / 0.5e9
    t_adam = N / 1e6
    assert s.fwd_bwd.seconds == pytest.approx(max(t_comp, t_nvme_mb))
    assert s.optimizer.seconds == pytest.approx(max(t_opt, t_adam))
    assert s.step_s == pytest.approx(2 * max(t_comp, t_nvme_mb) + max(t_opt, t_adam))
    assert s.optimizer.bound == "cpu_adam" and s.bound == "cpu_adam"
    # checkpointing adds one forward: (8*N + 16*L*H*S)*S*B FLOPs
    sc = est.configs[0].steps["checkpointing"]
    assert sc.fwd_bwd.terms["compute"] == pytest.approx((8 * N + attn * 4 // 3) * 32 / 1e12)


def test_infinity_estimate_is_callable_both_ways():
    import importlib
    mod = importlib.import_module("infinity.estimate")
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    a = infinity.estimate(params=1_000_000, layers=2, hidden=64, machine=m)
    b = mod(params=1_000_000, layers=2, hidden=64, machine=m)
    assert a.as_dict() == b.as_dict()
    with pytest.raises(EstimateError, match="describe the model"):
        infinity.estimate(layers=2, machine=m)


def test_knobs_from_infinity_config_and_overrides():
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    cfg = {"precision": "fp32", "prefetch": {"depth": 3}, "gradient_accumulation_steps": 4,
           "offload": {"host_memory_gb": 8}, "aio": {"queue_depth": 8}}
    est = estimate(small_spec(), machine=m, config=cfg, configs=[("nvme", "nvme")])
    k = est.knobs
    assert (k.precision, k.prefetch_depth, k.grad_accum, k.host_cap_gb, k.aio_queue_depth) == \
        ("fp32", 3, 4, 8.0, 8)
    it = items(est.configs[0].plan)
    assert it[("device", "fetched groups (in use + prefetch)")] == (3 + 2) * 50_000 * 4
    # keyword arguments override the config
    est = estimate(small_spec(), machine=m, config=cfg, precision="bf16", configs=[("nvme", "nvme")])
    assert est.knobs.precision == "bf16" and est.knobs.prefetch_depth == 3
    from infinity.config import ConfigError
    with pytest.raises(ConfigError):
        estimate(small_spec(), machine=m, config={"precision": "fp8"})


def test_spec_from_plain_module_without_config():
    import torch
    from torch import nn

    from infinity.estimate import spec_from_module

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up = nn.Linear(16, 64)
            self.down = nn.Linear(64, 16)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(100, 16)
            self.blocks = nn.ModuleList(Block() for _ in range(5))
            self.head = nn.Linear(16, 100, bias=False)
            self.head.weight = self.emb.weight          # tied: counted once

    with torch.device("meta"):
        net = Net()
    s = spec_from_module(net, seq=8, batch=1)
    per_block = 16 * 64 + 64 + 64 * 16 + 16
    assert s.params == 100 * 16 + 5 * per_block
    assert (s.layers, s.hidden, s.vocab) == (5, 16, 100)
    assert s.largest_group == {"module": 100 * 16, "block": per_block}
    with pytest.raises(EstimateError, match="hidden size"):
        spec_from_module(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))


def test_traffic_with_the_parameter_cache():
    """fp32, params and optimizer on NVMe, one CPU process, a host cap above the plan: the
    host pool keeps clean copies of the params (write-through), so reads shrink to what
    does not fit; with the overlap only ~2 groups' gradients are live."""
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100, nvme_gbps=1.0, nvme_write_gbps=0.5,
                tflops=1.0, cpu_adam_gparams=0.001)
    N = 1_000_000
    base = estimate(small_spec(), machine=m, precision="fp32", configs=[("nvme", "nvme")],
                    gradient_clipping=1.0, host_cap_gb=1.0)
    t = base.configs[0].steps["none"].traffic
    assert t["nvme_read"] == 8 * N                  # m + v only: every param copy fits
    assert t["nvme_write"] == 12 * N                # master written through, m, v
    tight = estimate(small_spec(), machine=m, precision="fp32", configs=[("nvme", "nvme")],
                     host_cap_gb=None)
    t = tight.configs[0].steps["none"].traffic     # no cap: no cache, hand-off only
    assert t["nvme_read"] == 2 * N * 4 + 8 * N
    clipped = estimate(small_spec(), machine=m, precision="fp32", configs=[("nvme", "nvme")],
                       gradient_clipping=1.0, host_cap_gb=None)
    t = clipped.configs[0].steps["none"].traffic   # speculative early steps hand off too
    assert t["nvme_read"] == 2 * N * 4 + 8 * N
    # the cached copies are resident host memory: a pageable line, within the cap
    from infinity.estimate.step_time import PARAM_CACHE_ITEM
    c = base.configs[0]
    cache = [i for i in c.plan.items if i.name == PARAM_CACHE_ITEM]
    assert len(cache) == 1 and cache[0].tier == "pageable" and cache[0].nbytes == N * 4
    assert c.totals["pinned"] + c.totals["pageable"] <= 1.0 * 1e9
    assert not [i for i in tight.configs[0].plan.items if i.name == PARAM_CACHE_ITEM]
    # a cap that leaves less room than the params: the cache takes only the room
    small = estimate(small_spec(), machine=m, precision="fp32", configs=[("nvme", "nvme")],
                     gradient_clipping=1.0, host_cap_gb=0.01)
    c = small.configs[0]
    cache = [i.nbytes for i in c.plan.items if i.name == PARAM_CACHE_ITEM]
    assert cache and 0 < cache[0] < N * 4
    assert c.totals["pinned"] + c.totals["pageable"] <= 0.01 * 1e9


def test_cap_bounds_infinitys_own_host_tiers_not_the_reserve():
    """offload.host_memory_gb bounds pinned + pageable (+ the device tier CPU-only); the
    OS/runtime reserve is checked against the RAM, not the cap."""
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100)
    est = estimate(small_spec(), machine=m, precision="fp32", configs=[("cpu", "cpu")])
    c = est.configs[0]
    own = c.totals["host_none"] - c.totals["host_reserve"]
    just = estimate(small_spec(), machine=m, precision="fp32", configs=[("cpu", "cpu")],
                    host_cap_gb=own / 1e9 * 1.01)
    assert just.configs[0].fits["none"]         # the 2 GB reserve is not charged to the cap
    under = estimate(small_spec(), machine=m, precision="fp32", configs=[("cpu", "cpu")],
                     host_cap_gb=own / 1e9 * 0.5)
    assert not under.configs[0].fits["none"]
    assert any("offload.host_memory_gb" in p for p in under.configs[0].problems["none"])
    tiny_ram = Machine(gpus=0, host_mem_gb=own / 1e9 * 1.01, nvme_gb=100)
    e = estimate(small_spec(), machine=tiny_ram, precision="fp32", configs=[("cpu", "cpu")])
    assert any("RAM" in p for p in e.configs[0].problems["none"])   # reserve counts vs RAM


def test_streamed_gradients_make_no_round_trip():
    # one CPU process, bf16, grads on NVMe (cap 4.5 MB): host items = init staging 100 kB +
    # ring 3*51200*18 + grad staging 2*50000*4; the rest holds 2 in-hand gradients
    # (2*Gmax*4 = 400 kB) and then host accumulators: the groups are updated as their
    # gradient arrives, so the NVMe-homed fp32 grads are neither written nor read back
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100)
    cap = 0.0045
    est = {clip: estimate(small_spec(), machine=m, precision="bf16", host_cap_gb=cap,
                          gradient_clipping=clip, configs=[("nvme", "nvme")])
           for clip in (0.0, 1.0)}
    pl = est[0.0].configs[0].plan
    assert pl.grads_on_nvme and pl.grads_streamed
    it = items(pl)
    assert it[("pageable", "gradients in hand for their early step (grads on NVMe)")] == 2 * 50_000 * 4
    gn = it[("nvme", "grad accumulation (fp32, NVMe)")]
    assert gn > 0
    N = 1_000_000
    t = est[0.0].configs[0].steps["none"].traffic
    assert t["nvme_read"] == 2 * (N * 2) + N * 12          # params fwd+bwd, master/m/v
    assert t["nvme_write"] == N * 12 + N * 2                # master/m/v, bf16 params
    # with clipping and fp32 moments nothing more: a clipped step redoes from the moments
    # (Note [Redo from moments])
    tc = est[1.0].configs[0].steps["none"].traffic
    assert tc["nvme_read"] == t["nvme_read"] and tc["nvme_write"] == t["nvme_write"]
    # with bf16 moments the final sums are written (a clipped step redoes from them), not read
    lo = {clip: estimate(small_spec(), machine=m, precision="bf16", host_cap_gb=cap,
                         gradient_clipping=clip, configs=[("nvme", "nvme")], state_dtype="bf16")
          for clip in (0.0, 1.0)}
    assert lo[0.0].configs[0].plan.grads_streamed
    t0, t1 = (lo[c].configs[0].steps["none"].traffic for c in (0.0, 1.0))
    gn_lo = items(lo[0.0].configs[0].plan)[("nvme", "grad accumulation (fp32, NVMe)")]
    assert t1["nvme_read"] == t0["nvme_read"] and t1["nvme_write"] == t0["nvme_write"] + gn_lo


def test_state_dtype_from_the_config_halves_the_moments():
    """``optimizer.state_dtype: "bf16"`` in the config reaches the estimator (sb = 2): the
    NVMe moments and their traffic are half of fp32's; ``state_dtype=`` overrides it."""
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100)
    N = 1_000_000
    got = {}
    for sd in ("fp32", "bf16"):
        est = estimate(small_spec(), machine=m, config={"precision": "bf16",
                                                         "optimizer": {"state_dtype": sd}},
                       configs=[("nvme", "nvme")], gradient_clipping=1.0)
        assert est.knobs.state_dtype == sd
        got[sd] = est.configs[0].steps["none"].traffic
    for link in ("nvme_read", "nvme_write"):       # m + v: 8 -> 4 B per param, each way
        assert got["fp32"][link] - got["bf16"][link] == 4 * N
    est = estimate(small_spec(), machine=m, config={"optimizer": {"state_dtype": "bf16"}},
                   state_dtype="fp32", configs=[("nvme", "nvme")])
    assert est.knobs.state_dtype == "fp32"


def test_commit_undo_copies_follow_the_engine_rule():
    """Note [commit point]: undo copies of host states updated in place exist when the
    step can roll back half-way (swap space, or the overlapped step), within the cap."""
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=10)
    key = ("pageable", "commit undo copies (host states, per update)")
    # fp16 turns the overlap off (the loss scaler) and there is no swap space: no undo copies
    pl = plan_memory(small_spec(), m, Knobs(precision="fp16"), "cpu", "cpu")
    assert key not in items(pl)
    # clipping keeps the (speculative) overlap: undo copies (Note [Speculative clipping])
    pl = plan_memory(small_spec(), m, Knobs(precision="fp32", gradient_clipping=1.0),
                     "cpu", "cpu")
    assert items(pl)[key] == 1_000_000 * 12
    # swap space (optimizer on NVMe): only the host part (fp32 master = param home) has copies
    pl = plan_memory(small_spec(), m, Knobs(precision="fp32", gradient_clipping=1.0),
                     "cpu", "nvme")
    assert items(pl)[key] == 1_000_000 * 4
    # under a tight cap the overlapped step undoes only what the cap leaves
    k = Knobs(precision="fp32", host_cap_gb=0.02)
    pl = plan_memory(small_spec(), m, k, "cpu", "cpu")
    others = sum(v for (t, n), v in items(pl).items() if t in ("pinned", "pageable") and
                 (t, n) != key)
    assert items(pl).get(key, 0) == max(0, min(12_000_000, int(0.02e9) - others))


def test_tiling_bounds_the_fetch_window_by_the_tile():
    """tiling.max_group_gb: one fetch puts at most a tile of a tileable group on the device,
    but never less than the largest group tiling cannot split; across ranks at ZeRO stage 3
    too (each rank holds the whole gathered tile), not at stages 1-2 nor with ZeRO++."""
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    spec = small_spec()                             # Gmax 50 000, untileable: 2*hidden = 128
    key = ("device", "fetched groups (in use + prefetch)")
    cfg = {"precision": "fp32", "tiling": {"max_group_gb": 40_000 / GB}}   # 10 000 fp32 elements
    est = estimate(spec, machine=m, config=cfg, configs=[("nvme", "nvme")])
    assert est.knobs.tiling_max_group_gb == 40_000 / GB
    assert items(est.configs[0].plan)[key] == (2 + 2) * 10_000 * 4
    assert any("tiling" in n for n in est.configs[0].plan.notes)
    spec.largest_untileable = 20_000               # e.g. a Conv1D matrix: fetched whole
    est = estimate(spec, machine=m, config=cfg, configs=[("nvme", "nvme")])
    assert items(est.configs[0].plan)[key] == (2 + 2) * 20_000 * 4
    est = estimate(spec, machine=m, precision="fp32", configs=[("nvme", "nvme")])   # no tiling
    assert items(est.configs[0].plan)[key] == (2 + 2) * 50_000 * 4
    m2 = Machine(gpus=2, gpu_mem_gb=1, host_mem_gb=100, nvme_gb=1, gpu_reserve_gb=0)
    est = estimate(spec, machine=m2, config=cfg, configs=[("nvme", "nvme")])
    assert items(est.configs[0].plan)[key] == (2 + 2) * 20_000 * 4
    # (stage 3 is the default; ZeRO++ gathers whole groups: no tiling)
    est = estimate(spec, machine=m2, config={**cfg, "zero_pp": {"hpz_partition_size": 2}},
                   configs=[("nvme", "nvme")])
    assert items(est.configs[0].plan)[key] == (2 + 2) * 50_000 * 4


def test_zero_cpu_ranks_count_gradients_awaiting_reduction():
    """CPU-only ranks at stage >= 2: full fp32 gradients of (MAX_INFLIGHT_REDUCTIONS + 2)
    groups reduced whole (Gmax, or Gf with tiling) on the host; the optimizer tile ring
    covers a rank's shard of the largest group."""
    from infinity.estimate.memory_plan import ZERO_INFLIGHT_REDUCTIONS
    from infinity.zero.partitioned_grads import MAX_INFLIGHT_REDUCTIONS
    assert ZERO_INFLIGHT_REDUCTIONS == MAX_INFLIGHT_REDUCTIONS
    k = MAX_INFLIGHT_REDUCTIONS + 2
    spec = small_spec()                             # Gmax 50 000
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100, nodes=2)
    cfg = {"precision": "fp32", "zero_stage": 3}
    plan = estimate(spec, machine=m, config=cfg, configs=[("nvme", "nvme")]).configs[0].plan
    assert items(plan)[("pageable", f"gradients awaiting reduce-scatter (fp32, {k} x Gmax)")] \
        == k * 50_000 * 4
    ring = items(plan)[("pinned", "optimizer tile ring")]
    assert ring == 3 * (-(-25_000 // 2048) * 2048) * 16
    cfg["tiling"] = {"max_group_gb": 40_000 / GB}
    plan = estimate(spec, machine=m, config=cfg, configs=[("nvme", "nvme")]).configs[0].plan
    assert items(plan)[("pageable", f"gradients awaiting reduce-scatter (fp32, {k} x Gf)")] \
        == k * 10_000 * 4
    for stage in (1,):                              # stage 1 all-reduces the full buffers
        plan = estimate(spec, machine=m, config={"precision": "fp32", "zero_stage": stage},
                        configs=[("none", "cpu")]).configs[0].plan
        assert not any("awaiting" in n for _, n in items(plan))


def test_spec_from_module_largest_untileable():
    torch = pytest.importorskip("torch")
    from torch import nn
    from infinity.estimate import spec_from_module

    class Odd(nn.Module):                          # a module tiling cannot split
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(30, 10))

    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 10), nn.Linear(10, 50), Odd(), nn.LayerNorm(10))
    s = spec_from_module(model, seq=4)
    assert s.largest_group["module"] == 1000 and s.largest_untileable == 300
    assert s.fetched_numel("module", 400) == 400 and s.fetched_numel("module", 100) == 300
    assert s.fetched_numel("module", None) == 1000


def test_traffic_with_the_shard_cache_across_ranks():
    """ZeRO stage 3 on 2 CPU ranks (one per node), fp32, params and optimizer on NVMe: with
    a host cap above a rank's share of the plan each rank caches its own shards (Note
    [Shard cache]); forward reads what does not fit, backward what was neither kept for
    reuse nor cached once the gradients awaiting their reduce-scatter took their room."""
    from infinity.estimate.step_time import PARAM_CACHE_ITEM
    m = Machine(gpus=0, host_mem_gb=100, nvme_gb=100, nodes=2)
    N, S = 1_000_000, 500_000 * 4               # params; one rank's shard bytes (= a node's)
    mv = 2 * 4 * N // 2                        # a node's m + v, read once per step

    def run(cap, zero_pp=None):
        cfg = {"precision": "fp32", "zero_stage": 3}
        if zero_pp:
            cfg["zero_pp"] = zero_pp
        c = estimate(small_spec(), machine=m, config=cfg, configs=[("nvme", "nvme")],
                     host_cap_gb=cap).configs[0]
        cache = [i.nbytes for i in c.plan.items if i.name == PARAM_CACHE_ITEM]
        return c.steps["none"].traffic["nvme_read"], cache, c
    # no cap: no cache; backward's groups are all kept from forward (reuse, k = 1)
    read, cache, _ = run(None)
    assert read == S + mv and cache == []
    # room for every shard: only the moments are read
    read, cache, c = run(1.0)
    assert read == mv and cache == [S]
    # a rank's other host items (init staging excluded): grads N/R*4, the tile ring; the
    # full gradients awaiting their reduce-scatter evict copies during backward
    others = sum(i.nbytes for i in c.plan.items if i.tier in ("pinned", "pageable")
                 and i.name != PARAM_CACHE_ITEM and "initialisation" not in i.name
                 and not i.name.startswith("gradients awaiting"))
    cap = others + 800_000                      # room for 0.8 MB of copies before backward
    read, cache, _ = run(cap / 1e9)             # (a cap of 4.08 MB: no gradient spill)
    assert read == (S - 800_000) + mv
    # the plan line is what stays resident next to backward's gradient buffers: none
    assert cache == []
    # 2.3 MB of room: every shard before backward (2 MB), 1.1 MB of them during it
    # (reads: forward none, backward none: kept for reuse); the plan line: the cap's rest
    # once the gradient buffers (1.2 MB) and the init staging (0.2 MB) are counted
    read, cache, _ = run((cap + 1_500_000) / 1e9)
    assert read == mv and cache == [2_300_000 - 1_200_000 - 200_000]
    # ZeRO++ turns it off
    read, cache, _ = run(1.0, zero_pp={"quantized_weights": True})
    assert cache == [] and read == S + mv
