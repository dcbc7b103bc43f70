"""`infinity estimate --plan`: the planner picks the fastest configuration that fits, its
output format (the headline, the JSON schema), and that it never picks a lossy choice
without --allow-lossy.  The planner's choice is checked against a brute-force search with
the estimator itself (every homes / checkpointing / activation / split / depth
combination evaluated one by one through ``infinity.estimate``)."""
import itertools
import json
import re

import pytest

from infinity.cli.main import main
from infinity.estimate import Machine, estimate, spec_from_dims
from infinity.estimate.memory_plan import Knobs
from infinity.estimate.planner import ACTIVATION_CHOICES, default_global_batch, make_plan

REF = ["--params", "1T", "--layers", "128", "--hidden", "25600", "--vocab", "64000",
       "--gpus", "8", "--gpu-mem", "80", "--host-mem", "2000", "--nvme-gb", "30000",
       "--nvme-drives", "8", "--nvme-gbps", "56", "--nvme-write-gbps", "40", "--tflops", "400"]
NODE = dict(gpus=8, gpu_mem_gb=80, host_mem_gb=2000, nvme_gb=30000, nvme_drives=8,
            nvme_gbps=56, nvme_write_gbps=40, tflops=400)
SCHEMA = {"plan", "micro_batch", "grad_accum", "step_s", "tokens_per_s",
          "compute_bound_tokens_per_s", "lossy", "alternatives"}


def _brute_force(dims, machine, global_batch, lossy, precision="bf16", clip=0.0, tiles=(None,)):
    """The fastest fitting (step_s, description) by calling estimate() per combination
    (``machine``: the one the plan was made for -- headroom kept, drives derated)."""
    R = machine.ranks
    per_rank = global_batch // R
    best = None
    states = ("fp32", "bf16") if lossy else ("fp32",)
    for B in [b for b in range(1, per_rank + 1) if per_rank % b == 0]:
        A = per_rank // B
        for sd, gd, (ah, sc), d, t in itertools.product(
                states, ("fp32", "bf16") if lossy and A > 1 else ("fp32",),
                ACTIVATION_CHOICES, (1, 2, 3), tiles):
            est = estimate(**dims, batch=B, machine=machine, precision=precision, grad_accum=A,
                           prefetch_depth=d, state_dtype=sd, grad_accum_dtype=gd,
                           activation_home=ah, activation_scope=sc, gradient_clipping=clip,
                           tiling_max_group_gb=t,
                           host_cap_gb=(machine.host_mem_gb - 2) if R == 1 else None)
            for c in est.configs:
                for v in ("checkpointing", "none"):
                    if c.fits[v] and (best is None or c.steps[v].step_s < best[0] * (1 - 1e-9)):
                        best = (c.steps[v].step_s, (c.params_home, c.optimizer_home, v, ah, sc, B))
    return best


def _twenty_b():
    """A 20B model on 2 x 24 GB GPUs with 256 GB RAM: offload is needed and the micro-batch
    and activation placement matter."""
    dims = dict(params=20_000_000_000, layers=44, hidden=6144, vocab=50000, seq=2048)
    m = Machine(gpus=2, gpu_mem_gb=24, host_mem_gb=256, nvme_gb=2000, nvme_drives=2,
                nvme_gbps=12, nvme_write_gbps=8, tflops=100)
    spec = spec_from_dims(dims["params"], dims["layers"], dims["hidden"], vocab=dims["vocab"],
                          seq=dims["seq"])
    return dims, m, spec


@pytest.mark.parametrize("lossy", [False, True])
def test_plan_matches_brute_force_and_beats_every_fixed_choice(lossy):
    dims, m, spec = _twenty_b()
    plan = make_plan(spec, m, Knobs(), global_batch=16, allow_lossy=lossy)
    from infinity.estimate.planner import _tile_choices
    bf = _brute_force(dims, plan.machine, 16, lossy, clip=plan.best.knobs.gradient_clipping,
                      tiles=(None, *_tile_choices(spec, Knobs(), m.ranks, "nvme")))
    assert plan.best is not None and bf is not None
    assert plan.best.step.step_s == pytest.approx(bf[0], rel=1e-9)
    assert plan.best.fits and plan.best.lossy == (lossy and plan.best.lossy)
    if not lossy:
        assert not plan.best.lossy
        cfg = plan.best.config()
        assert "optimizer" not in cfg and "gradient_accumulation_dtype" not in cfg
    # the split multiplies to the global batch
    assert plan.best.micro_batch * plan.best.grad_accum * m.ranks == 16
    # every alternative is slower or equal, and fits
    for a in plan.alternatives:
        assert a.fits and a.step.step_s >= plan.best.step.step_s


def test_plan_config_round_trips_through_the_estimator():
    """The config block, fed back to the estimator, gives the plan's step time and fits."""
    from infinity.config import InfinityConfig

    dims, m, spec = _twenty_b()
    plan = make_plan(spec, m, Knobs(), global_batch=16, allow_lossy=True)
    b = plan.best
    cfg = b.config()
    InfinityConfig.load(cfg)           # a valid infinity config
    est = estimate(**dims, batch=b.micro_batch, machine=plan.machine, config=cfg,
                   configs=[(cfg["offload"]["params"], cfg["offload"]["optimizer"])])
    c = est.configs[0]
    v = "checkpointing" if b.checkpointing else "none"
    assert c.fits[v]
    assert c.steps[v].step_s == pytest.approx(b.step.step_s, rel=1e-12)


def test_reference_node_text_output(capsys):
    assert main(["estimate", *REF, "--seq", "2048", "--plan"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("machine: ")                 # the machine planned for comes first
    first = next(line for line in out.splitlines() if line.startswith("Plan: "))
    assert re.fullmatch(r"Plan: MFU [0-9.]+ % \(hardware FLOPs utilization [0-9.]+ %, recompute "
                        r"counted\): .*step [0-9.]+ s, [0-9.]+ tokens/s", first), first
    assert "lossless" in first and "derivation:" in out
    # the config block is the last thing printed, valid JSON
    block = out[out.index("\n{") + 1:]
    cfg = json.loads(block)
    assert cfg["offload"]["params"] == "nvme" and "gradient_accumulation_steps" in cfg
    # the plan beats the issue-17 figure for the same global batch (B 1 x A 16: 58.9 tokens/s)
    tps = float(first.rsplit(" ", 2)[-2])
    assert tps > 58.9


def test_reference_node_json_schema(capsys):
    assert main(["estimate", *REF, "--seq", "2048", "--plan", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert SCHEMA <= set(d)
    assert d["lossy"] is False and d["compute_bound_tokens_per_s"] == pytest.approx(400.0)
    assert d["micro_batch"] * d["grad_accum"] * 8 == 128     # 262144 tokens / 2048
    assert d["tokens_per_s"] == pytest.approx(128 * 2048 / d["step_s"])
    for a in d["alternatives"]:
        assert {"plan", "micro_batch", "grad_accum", "step_s", "tokens_per_s", "lossy"} <= set(a)
        assert a["step_s"] >= d["step_s"]
    assert main(["estimate", *REF, "--seq", "2048", "--plan", "--json", "--allow-lossy"]) == 0
    lossy = json.loads(capsys.readouterr().out)
    assert lossy["step_s"] <= d["step_s"]
    if lossy["lossy"]:
        assert lossy["plan"].get("optimizer", {}).get("state_dtype") == "bf16" or \
            lossy["plan"].get("gradient_accumulation_dtype") == "bf16"


def test_reference_node_seq_4096_fits(capsys):
    # issue 17: at seq 4096 (batch 4, accumulation 16) nothing fit
    assert main(["estimate", *REF, "--seq", "4096", "--plan", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["plan"] is not None and d["step_s"] > 0


def test_pinned_batch_and_nothing_fits(capsys):
    spec = spec_from_dims(10**12, 128, 25600, vocab=64000, seq=2048)
    p = make_plan(spec, Machine(**NODE), Knobs(), micro_batch=2)
    assert p.best.micro_batch == 2 and p.global_batch % 16 == 0
    with pytest.raises(Exception, match="multiple"):
        make_plan(spec, Machine(**NODE), Knobs(), global_batch=12)
    # 4 TB of NVMe cannot hold 1T parameters' states: a No with the closest candidate's problems
    tiny = Machine(**{**NODE, "nvme_gb": 4000})
    p = make_plan(spec, tiny, Knobs())
    assert p.best is None and p.closest is not None and p.headline().startswith("No plan fits")
    d = p.as_dict()
    assert d["plan"] is None and d["closest"]["problems"]
    assert main(["estimate", *REF, "--nvme-gb", "4000", "--plan"]) == 1
    out = capsys.readouterr().out
    assert out.startswith("machine:") and "\nNo plan fits" in out


def test_cli_rejects_planner_flags_without_plan_and_lossy_states_without_allow(capsys):
    assert main(["estimate", *REF, "--allow-lossy"]) != 0
    assert "go with --plan" in capsys.readouterr().err
    spec = spec_from_dims(10**12, 128, 25600, vocab=64000, seq=2048)
    with pytest.raises(Exception, match="allow-lossy"):
        make_plan(spec, Machine(**NODE), Knobs(state_dtype="bf16"))


def test_default_global_batch():
    assert default_global_batch(2048, 8) == 128
    assert default_global_batch(4096, 8) == 64
    assert default_global_batch(100, 3) % 3 == 0 and default_global_batch(100, 3) * 100 >= 1 << 18


def test_planner_tiles_when_nothing_fits_untiled():
    """One rank, a 1M-element group under a 25 MB host cap: no untiled configuration fits
    (the params-on-NVMe fetch window alone is (d+2)*4 MB), tiles of Gmax/16 do; the config
    block carries tiling.max_group_gb and the estimator agrees it fits, untiled it does not."""
    from infinity.estimate import ModelSpec
    spec = ModelSpec(params=2_000_000, layers=2, hidden=64, seq=16, batch=1, heads=2,
                     largest_group={"module": 1_000_000, "block": 1_000_000},
                     groups={"module": 10, "block": 3})
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100)
    plan = make_plan(spec, m, Knobs(precision="fp32", host_cap_gb=0.025), global_batch=2)
    best = plan.best
    assert best is not None and best.knobs.tiling_max_group_gb == 0.00025   # 62 500 fp32
    cfg = best.config()
    assert cfg["tiling"] == {"max_group_gb": 0.00025} and "tiling above" in best.describe()
    kw = dict(machine=m, precision="fp32", host_cap_gb=0.025, batch=best.micro_batch,
              grad_accum=best.knobs.grad_accum, prefetch_depth=best.knobs.prefetch_depth,
              configs=[(best.params_home, best.optimizer_home)])
    v = "checkpointing" if best.checkpointing else "none"
    assert estimate(spec, tiling_max_group_gb=0.00025, **kw).configs[0].fits[v]
    assert not estimate(spec, tiling_max_group_gb=0.001, **kw).configs[0].fits[v]   # Gmax/4
    assert not estimate(spec, **kw).configs[0].fits[v]


def test_reference_node_plan(capsys):
    """The 1T reference node (8 ranks, ZeRO stage 3): the lossless plan reports its MFU on
    the model FLOPs basis (6*N + 12*L*H*S per token, recompute not counted), with 10 % of
    the NVMe and host memory kept free, drives at 0.8 and clipping at 1.0.  Its groups'
    gradients fit the device untiled thanks to the gradient buckets (Note [Gradient
    buckets]); with whole-group reductions the plan must tile the largest groups."""
    assert main(["estimate", *REF, "--seq", "2048", "--plan", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["lossy"] is False and d["plan"]["zero_stage"] == 3
    assert d["plan"].get("reduce_bucket_mb", 128) > 0
    assert main(["estimate", *REF, "--seq", "2048", "--plan", "--json",
                 "--reduce-bucket-mb", "0"]) == 0
    whole = json.loads(capsys.readouterr().out)
    assert "tiling" in whole["plan"] and whole["plan"]["reduce_bucket_mb"] == 0
    per_token = 6 * 10**12 + 12 * 128 * 25600 * 2048
    assert d["mfu"] == pytest.approx(d["tokens_per_s"] * per_token / (8 * 400e12))
    assert d["hardware_flops_utilization"] > d["mfu"] > 0.3
    assert d["nvme_derate"] == 0.8 and d["gradient_clipping"] == 1.0
    assert d["nvme_used_fraction"] <= 0.9 + 1e-9
    assert d["drive_tb_written_per_step"] > 0


def test_tile_choices_across_ranks():
    """Tiling is searched at world size > 1 only where the runtime tiles: stage 3 with paged
    parameters and without ZeRO++."""
    from infinity.estimate.planner import _tile_choices
    spec = spec_from_dims(params=10_000_000_000, layers=8, hidden=8192, seq=2048, vocab=64000)
    k = Knobs(precision="bf16")
    assert _tile_choices(spec, k, 8, "nvme") and _tile_choices(spec, k, 1, "nvme")
    assert not _tile_choices(spec, k, 8, "none")
    assert not _tile_choices(spec, Knobs(precision="bf16", zero_stage=2), 8, "nvme")
    assert not _tile_choices(spec, Knobs(precision="bf16", hpz=8), 8, "nvme")
    assert _tile_choices(spec, Knobs(precision="bf16", hpz=8), 1, "nvme")
