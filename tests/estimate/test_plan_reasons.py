"""Why the planner chose what it chose (infinity/estimate/plan_reasons.py): one sentence
per choice, each quoting the number that decided it, and that number checked here against
the estimator itself (``infinity.estimate.estimate`` of the configuration the sentence
compares with, evaluated independently of the planner)."""
import re

import pytest

from infinity.estimate import Machine, estimate, spec_from_dims
from infinity.estimate.memory_plan import Knobs
from infinity.estimate.planner import make_plan

# a 70B model on one 24 GB GPU: every choice is forced by a limit
DIMS = dict(params=70_000_000_000, layers=80, hidden=8192, vocab=32000, seq=4096)
MACHINE = Machine(gpus=1, gpu_mem_gb=24, host_mem_gb=256, nvme_gb=4000, nvme_drives=2,
                  nvme_gbps=12, nvme_write_gbps=8, tflops=150)


@pytest.fixture(scope="module")
def plan():
    spec = spec_from_dims(DIMS["params"], DIMS["layers"], DIMS["hidden"], vocab=DIMS["vocab"],
                          seq=DIMS["seq"])
    return make_plan(spec, MACHINE, Knobs(precision="bf16"))


def _sentence(reasons, start):
    hits = [r for r in reasons if r.startswith(start)]
    assert len(hits) == 1, (start, reasons)
    return hits[0]


def _est(plan, **over):
    """The estimator's answer for the chosen configuration with ``over`` changed."""
    b = plan.best
    k = b.knobs
    # (the machine the plan was made for: headroom kept free, drives derated)
    kw = dict(batch=b.micro_batch, machine=plan.machine, precision="bf16", grad_accum=b.grad_accum,
              gradient_clipping=k.gradient_clipping,
              prefetch_depth=k.prefetch_depth, activation_home=k.activation_home,
              activation_scope=k.activation_scope, host_cap_gb=k.host_cap_gb,
              tiling_max_group_gb=k.tiling_max_group_gb)
    homes = over.pop("homes", (b.params_home, b.optimizer_home))
    variant = over.pop("variant", b.variant)
    kw.update(over)
    est = estimate(**DIMS, **kw)
    c = next(c for c in est.configs if (c.params_home, c.optimizer_home) == homes)
    return c, variant


def test_one_sentence_per_choice_in_order(plan):
    r = plan.reasons()
    starts = ["homes offload.params", "activation checkpointing", "activations offloaded to",
              "micro-batch", "prefetch depth"]
    assert [next(s for s in starts if x.startswith(s)) for x in r[:5]] == starts, r
    b = plan.best
    assert r[0].startswith(f"homes offload.params {b.params_home}, offload.optimizer "
                           f"{b.optimizer_home}:")
    assert f"micro-batch {b.micro_batch} x accumulation {b.grad_accum}" in r[3]


def test_each_quoted_limit_is_the_estimators(plan):
    b = plan.best
    r = plan.reasons()
    # micro-batch: the next larger one does not fit, for the reason the estimator gives
    s = _sentence(r, "micro-batch")
    nb = int(re.search(r"micro-batch (\d+) does not fit", s).group(1))
    assert nb > b.micro_batch
    c, v = _est(plan, batch=nb, grad_accum=b.micro_batch * b.grad_accum // nb)
    assert not c.fits[v] and c.problems[v][0] in s
    # checkpointing: without it the device need the estimator computes
    s = _sentence(r, "activation checkpointing on")
    c, v = _est(plan, variant="none")
    assert not c.fits[v] and c.problems[v][0] in s
    # activation offload: kept on the device it does not fit
    s = _sentence(r, "activations offloaded to")
    c, v = _est(plan, activation_home="none", activation_scope="checkpoints")
    assert not c.fits[v] and c.problems[v][0] in s
    # homes: the quoted less offloaded pair does not fit, for the estimator's reason
    s = _sentence(r, "homes offload.params")
    p, o = re.search(r"params (\w+), optimizer (\w+)\) does not fit", s).groups()
    c, v = _est(plan, homes=(p, o))
    assert not c.fits[v] and c.problems[v][0] in s


def test_a_fitting_alternative_is_quoted_with_both_step_times():
    """A small model on a big node: everything fits; the sentences give step times."""
    spec = spec_from_dims(1_000_000_000, 24, 2048, vocab=32000, seq=1024)
    m = Machine(gpus=1, gpu_mem_gb=80, host_mem_gb=512, nvme_gb=2000, nvme_drives=1,
                nvme_gbps=6, nvme_write_gbps=4, tflops=300)
    plan = make_plan(spec, m, Knobs(precision="bf16"))
    r = plan.reasons()
    s = _sentence(r, "activation checkpointing")
    times = [float(x) for x in re.findall(r"([\d.]+) s per step", s)]
    assert times, s
    other = next(c for c in plan.candidates if c.checkpointing != plan.best.checkpointing)
    assert f"{other.step.step_s:.4g}"[:4] in s or any(abs(t - other.step.step_s) / other.step.step_s
                                                      < 0.01 for t in times)
    assert r[0].startswith("homes offload.params none, offload.optimizer none: the least "
                           "offloaded homes fit")
    assert "nothing is fetched" in _sentence(r, "prefetch depth")


def test_nothing_fits_has_no_reasons():
    spec = spec_from_dims(70_000_000_000, 80, 8192, vocab=32000, seq=4096)
    m = Machine(gpus=1, gpu_mem_gb=24, host_mem_gb=64, nvme_gb=100, nvme_drives=1)
    plan = make_plan(spec, m, Knobs(precision="bf16"))
    assert plan.best is None and plan.reasons() == []
