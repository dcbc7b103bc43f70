"""Activations of a fused attention (SDPA / flash attention keep no S x S scores): the
estimator reads Hugging Face's ``_attn_implementation`` and drops Korthikanti et al.'s
``5*a*S/H`` term for it.  Against the device peaks measured on an H200 (torch's max
allocated; docs/benchmarks.md "On a GPU"): a 3.02B Llama (d 3072, 28 layers, GQA 24/8,
vocab 32000, untied), bf16, params and optimizer in host memory, activation
checkpointing, sequence 2048: 10.40 GB at micro-batch 8, 77.0 GB at micro-batch 64.
"""
import pytest
import torch
import transformers

from infinity.estimate import knobs_from, spec_from_module
from infinity.estimate.machine import Machine
from infinity.estimate.model_spec import attention_keeps_scores
from infinity.estimate.planner import make_plan

H200 = {8: 10.40e9, 64: 77.0e9}


def _llama(attn):
    cfg = transformers.LlamaConfig(hidden_size=3072, intermediate_size=8192,
                                   num_hidden_layers=28, num_attention_heads=24,
                                   num_key_value_heads=8, vocab_size=32000,
                                   tie_word_embeddings=False)
    cfg._attn_implementation = attn
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(cfg)


def test_attention_kind_from_the_config():
    ns = transformers.PretrainedConfig()
    assert attention_keeps_scores(None) is None
    for impl, want in (("eager", True), ("sdpa", False), ("flash_attention_2", False),
                       ("flex_attention", False), ("something_new", None)):
        ns._attn_implementation = impl
        assert attention_keeps_scores(ns) is want, impl


@pytest.mark.parametrize("micro_batch", [8, 64])
def test_device_peak_against_the_h200(micro_batch):
    spec = spec_from_module(_llama("sdpa"), seq=2048)
    assert spec.attention_scores is False and spec.params == 3_015_355_392
    machine = Machine(gpus=1, gpu_mem_gb=150.1, host_mem_gb=130.0, nvme_gb=68.6,
                      pcie_gbps=55.2, tflops=290.0)
    knobs = knobs_from({"precision": "bf16", "zero_stage": 3,
                        "offload": {"params": "cpu", "optimizer": "cpu"}}, {})
    plan = make_plan(spec, machine, knobs, micro_batch=micro_batch, grad_accum=1,
                     checkpointing=True, activations=(("none", "checkpoints"),),
                     homes=[("cpu", "cpu")], nvme_headroom=0.0, host_headroom=0.0,
                     nvme_derate=1.0, clip=0.0)
    b = plan.best
    pred = b.estimate.totals[f"device_{b.variant}"]
    assert 0.9 <= H200[micro_batch] / pred <= 1.1, (H200[micro_batch], pred)
    # eager attention keeps the scores: the same model predicts more
    eager = spec_from_module(_llama("eager"), seq=2048)
    assert eager.attention_scores is True
    plan_e = make_plan(eager, machine, knobs, micro_batch=micro_batch, grad_accum=1,
                       checkpointing=True, activations=(("none", "checkpoints"),),
                       homes=[("cpu", "cpu")], nvme_headroom=0.0, host_headroom=0.0,
                       nvme_derate=1.0, clip=0.0)
    e = plan_e.best
    assert e.estimate.totals[f"device_{e.variant}"] > 1.2 * pred
