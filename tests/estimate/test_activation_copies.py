"""CPU-only activation offload (infinity/estimate/step_time.py ``_activation_copies``): the
copies into staging and back run on the computing cores, and every saved tensor sent to
NVMe has a fixed cost, so the compute term of a micro-batch grows by
``2 * offloaded bytes / host_copy_gbps (+ tensors * ACTIVATION_NVME_TENSOR_S)``; with a GPU
the copies are DMA and nothing is added.  Also the probes ``finetune --auto`` feeds it."""
import pytest

from infinity.estimate import Machine, estimate
from infinity.estimate.step_time import ACTIVATION_NVME_TENSOR_S, SAVED_TENSORS_PER_LAYER

DIMS = dict(params=5_000_000, layers=4, hidden=320, vocab=264, seq=512, batch=1)


def _compute(machine, home, scope="all"):
    est = estimate(**DIMS, machine=machine, precision="fp32", activation_home=home,
                   activation_scope=scope)
    c = next(c for c in est.configs if (c.params_home, c.optimizer_home) == ("none", "none"))
    off = c.plan.activation_offload.get("none")
    return c.steps["none"].fwd_bwd.terms.get("compute", 0.0), off


@pytest.mark.parametrize("home", ["nvme", "cpu"])
def test_cpu_only_compute_carries_the_copies(home):
    m = Machine(gpus=0, host_mem_gb=64, nvme_gb=100, tflops=0.1, host_copy_gbps=2.0)
    base, _ = _compute(m, "none")
    got, off = _compute(m, home)
    want = 2 * off.nbytes / 2e9
    if home == "nvme":
        want += DIMS["layers"] * SAVED_TENSORS_PER_LAYER["all"] * ACTIVATION_NVME_TENSOR_S
    assert off.nbytes > 0
    assert got - base == pytest.approx(want, rel=1e-9)


def test_a_gpu_adds_no_copy_term():
    m = Machine(gpus=1, gpu_mem_gb=80, host_mem_gb=64, nvme_gb=100, tflops=100)
    base, _ = _compute(m, "none")
    got, off = _compute(m, "cpu")
    assert off.nbytes > 0 and got == pytest.approx(base)


def test_auto_probes():
    import torch

    from infinity.estimate import spec_from_module
    from infinity.finetune.auto import (BLOCK_PROBE_MAX_FLOP, measure_copy_gbps,
                                        measure_model_tflops, model_config_path)
    from infinity.finetune.model import build_model, load_model_config, parameters_on_meta
    cfg = load_model_config(model_config_path("tiny-gpt2"))
    with parameters_on_meta():
        spec = spec_from_module(build_model(cfg), seq=64)
    torch.manual_seed(0)
    assert measure_model_tflops(cfg, spec, 64, 2, seconds=0.05) > 0
    too_big = int(BLOCK_PROBE_MAX_FLOP / (6 * spec.params * 64)) + 1
    assert measure_model_tflops(cfg, spec, 64, too_big) is None
    assert measure_copy_gbps(1 << 20, seconds=0.01) > 0
