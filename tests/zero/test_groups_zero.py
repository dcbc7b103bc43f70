"""ZeRO on 2 gloo ranks with a module that mixes a frozen weight and a trainable bias and
with ``optimizer.param_groups`` (per-group lr / weight decay / betas / eps), vs
single-process torch.optim.AdamW given the same groups."""
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import rank0_prefix, run_ranks  # noqa: E402
from zero_models import make_batches, make_model, unique_param_snapshot  # noqa: E402

STEPS = 6
BATCH = 8
MODEL = "awkward-mixed"
GROUPS = [{"params": ["blocks.0.*", "head.*"], "lr": 3e-2, "betas": [0.8, 0.99], "eps": 1e-6},
          {"params": ["frozen."], "weight_decay": 0.2}]


def _config(stage, offload, swap):
    return {"zero_stage": stage, "precision": "fp32", "dist_timeout_s": 60,
            "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.05,
                          "param_groups": GROUPS},
            "offload": {"params": offload if stage == 3 else "none",
                        "optimizer": offload, "nvme_paths": [swap]}}


def _reference(cfg):
    from infinity.config import InfinityConfig
    from infinity.optim.param_groups import build_param_groups_for_model
    torch.manual_seed(1234)
    model = make_model(MODEL)
    c = InfinityConfig.load(cfg)
    groups = build_param_groups_for_model(model, c.optimizer)
    assert len(groups) == 5              # top decay / no-decay, entry 0 both, entry 1 (wd set)
    opt = torch.optim.AdamW([{k: g[k] for k in ("params", "lr", "weight_decay", "betas", "eps")}
                             for g in groups])
    losses = []
    for x, y in make_batches(MODEL, STEPS, BATCH):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
    return losses, unique_param_snapshot(model)


def test_zero_param_groups_and_mixed_frozen_module(tmp_path):
    runs = []
    for stage, offload in ((3, "nvme"), (2, "cpu")):
        name = f"s{stage}-{offload}"
        runs.append({"name": name, "model": MODEL, "steps": STEPS, "batch": BATCH,
                     "config": _config(stage, offload, str(tmp_path / f"swap-{name}"))})
    res = run_ranks("dist_child.py", {"runs": runs, "check_state_dict": True}, tmp_path,
                    world_size=2, timeout=300)
    assert all(r.returncode == 0 and r.result is not None for r in res), \
        "\n".join(repr(r) for r in res)
    out = rank0_prefix(tmp_path)
    torch.manual_seed(1234)
    init = {n: p.detach().clone() for n, p in make_model(MODEL).named_parameters()}
    for run in runs:
        ref_losses, ref_params = _reference(run["config"])
        for r in res:
            got = r.result["runs"][run["name"]]["losses"]
            for i, (a, b) in enumerate(zip(got, ref_losses, strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{run['name']} rank {r.rank} step {i}"
        sd = load_file(f"{out}.{run['name']}.safetensors")
        assert set(sd) == set(ref_params)
        for k, ref in ref_params.items():
            rel = float((sd[k] - ref).norm() / ref.norm().clamp_min(1e-12))
            assert rel < 1e-5, f"{run['name']}: {k} differs (norm-relative {rel:.2e})"
        assert torch.equal(sd["frozen.weight"], init["frozen.weight"])
        assert not torch.equal(sd["frozen.bias"], init["frozen.bias"])
