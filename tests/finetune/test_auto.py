"""`infinity finetune --auto`: with the host budget squeezed below what any plan that keeps
its activations needs, the planner must offload or recompute activations, and the run it picks stays
within its own predicted budgets: the peak RSS above the torch runtime within the
estimator's validated 15 % of the predicted host memory (and under the cap), the swap
space the engine used within 15 % of the predicted NVMe bytes.  (Its step time is a
benchmark, not a test: docs/estimator.md "The planner".)"""
import json
import subprocess
import sys

import pytest

from infinity.estimate import Machine, knobs_from, spec_from_module
from infinity.estimate.planner import make_plan
from infinity.finetune.auto import model_config_path
from infinity.finetune.model import build_model, load_model_config, parameters_on_meta

from .conftest import child_env

SEQ, BATCH_TOKENS = 512, 4096      # 8 sequences per optimizer step: activations dominate

CHILD = r"""
import json, sys
import torch, transformers
import infinity, infinity.io, infinity.optim
from transformers import GPT2Config, GPT2LMHeadModel
from infinity.finetune.run import FinetuneOptions, finetune

def kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
torch.set_num_threads(1)
tiny = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2, n_positions=32))
t = torch.randint(0, 64, (2, 16))
tiny(input_ids=t, labels=t).loss.backward()
del tiny, t
import gc, ctypes; gc.collect(); ctypes.CDLL("libc.so.6").malloc_trim(0)
a = json.loads(sys.argv[1])
base = kb("VmRSS")
out = finetune(FinetuneOptions(model=a["model"], auto=True, steps=3, config=a["config"],
                               nvme_paths=[a["swap"]], use_bench_io=False, seq_len=a["seq"],
                               batch_tokens=a["tokens"]))
ap = out["auto"]
print(json.dumps({"base": base, "hwm": kb("VmHWM"), "pred_host": ap.predicted_host_bytes,
                  "pred_nvme": ap.predicted_nvme_bytes, "config": ap.config,
                  "micro_batch": ap.micro_batch, "grad_accum": ap.grad_accum,
                  "checkpointing": ap.checkpointing,
                  "nvme_peak": out["stats"].get("nvme_peak_bytes", 0),
                  "act_offload": out["stats"].get("activation_offload_bytes", 0),
                  "steps": len(out["records"])}))
"""


def _smallest_cap_without_offload(model):
    """The smallest offload.host_memory_gb (bisected) at which a plan that keeps every
    activation in the device tier (host memory here) without recomputing them still fits:
    below it the planner must offload activations or recompute them (checkpointing, 8
    instead of 6 FLOP per parameter and token, slower than moving them off here)."""
    cfg = load_model_config(model_config_path(model))
    with parameters_on_meta():
        meta = build_model(cfg)
    spec = spec_from_module(meta, seq=SEQ)
    m = Machine(gpus=0, host_mem_gb=1000, nvme_gb=1000)

    def fits(cap):
        knobs = knobs_from({"precision": "fp32", "gradient_clipping": 1.0,
                             "offload": {"host_memory_gb": cap}}, {})
        return make_plan(spec, m, knobs, global_batch=BATCH_TOKENS // SEQ,
                         activations=(("none", "checkpoints"),),
                         checkpointing=False).best is not None
    lo, hi = 0.0, 10.0
    assert fits(hi)
    while hi - lo > 1e-3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def test_auto_plan_offloads_activations_and_runs_within_its_budgets(tmp_path):
    floor = _smallest_cap_without_offload("tiny-llama")
    cap = round(0.9 * floor, 4)
    conf = tmp_path / "cap.json"
    conf.write_text(json.dumps({"offload": {"host_memory_gb": cap}}))
    args = {"model": "tiny-llama", "config": str(conf), "swap": str(tmp_path / "swap"),
            "seq": SEQ, "tokens": BATCH_TOKENS}
    p = subprocess.run([sys.executable, "-c", CHILD, json.dumps(args)], capture_output=True,
                       text=True, timeout=900, env=child_env())
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["steps"] == 3
    # the squeezed budget forces activations off the device tier or their recompute
    # (which is cheaper on a CPU-only machine, where the offload's copies take the
    # computing cores: the estimator's activation-copy term)
    offloaded = r["config"]["activation_offload"]["home"] != "none"
    assert offloaded or r["checkpointing"], r["config"]
    assert (r["act_offload"] > 0) == offloaded
    assert r["micro_batch"] * r["grad_accum"] == BATCH_TOKENS // SEQ
    meas = r["hwm"] - r["base"]
    assert r["pred_host"] <= cap * 1e9
    assert meas <= 1.15 * r["pred_host"], (meas, r["pred_host"])
    assert r["nvme_peak"] <= 1.15 * r["pred_nvme"] + 4096, (r["nvme_peak"], r["pred_nvme"])


def test_auto_nothing_fits_is_an_error(tmp_path):
    conf = tmp_path / "cap.json"
    conf.write_text(json.dumps({"offload": {"host_memory_gb": 0.001}}))
    from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune

    with pytest.raises(FinetuneError, match="No plan fits"):
        finetune(FinetuneOptions(model="tiny-llama", auto=True, steps=1, config=str(conf),
                                 nvme_paths=[str(tmp_path / "swap")], use_bench_io=False,
                                 seq_len=SEQ, batch_tokens=BATCH_TOKENS))
