"""ZeRO on 2 gloo ranks with ``optimizer.state_dtype: "bf16"``: each rank keeps its shard of
the Adam moments in bf16 (stage 3 + NVMe, stage 2 + CPU).  Reference: single-process
``torch.optim.AdamW`` on the global batch whose moments are rounded to bf16 after every
step (what storing them in bf16 means).  Tolerances (norm-relative): losses 1e-5 per step,
weights 1e-4 (a last-bit difference of an fp32 moment can flip its bf16 rounding), and
5x closer to that reference than to plain AdamW -- ranks that kept fp32 moments fail."""
import os
import sys

import torch
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from zero_harness import run_ranks_ok  # noqa: E402
from zero_models import make_batches, make_model, unique_param_snapshot  # noqa: E402

STEPS, BATCH, LR, WD = 10, 8, 1e-2, 0.05


def _config(stage, offload, swap):
    return {"zero_stage": stage, "precision": "fp32", "dist_timeout_s": 60,
            "optimizer": {"type": "adamw", "lr": LR, "weight_decay": WD, "state_dtype": "bf16"},
            "offload": {"params": offload if stage == 3 else "none", "optimizer": offload,
                        "nvme_paths": [swap]}}


def _reference(cfg, round_moments):
    from infinity.config import InfinityConfig
    from infinity.optim.param_groups import build_param_groups_for_model
    torch.manual_seed(1234)
    model = make_model("awkward")
    c = InfinityConfig.load(cfg)
    groups = build_param_groups_for_model(model, c.optimizer)
    opt = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]}
                             for g in groups], lr=LR, betas=tuple(c.optimizer.betas),
                            eps=c.optimizer.eps)
    losses = []
    for x, y in make_batches("awkward", STEPS, BATCH):
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(float(loss.detach()))
        opt.step()
        opt.zero_grad()
        if round_moments:
            for st in opt.state.values():
                for k in ("exp_avg", "exp_avg_sq"):
                    st[k].copy_(st[k].to(torch.bfloat16))
    return losses, unique_param_snapshot(model)


def _rel(a, b):
    num = sum(float((a[k].double() - b[k].double()).pow(2).sum()) for k in b)
    return (num / sum(float(b[k].double().pow(2).sum()) for k in b)) ** 0.5


def test_zero_two_ranks_bf16_states(tmp_path):
    runs = []
    for stage, offload in ((3, "nvme"), (2, "cpu")):
        name = f"s{stage}-{offload}-bf16"
        runs.append({"name": name, "model": "awkward", "steps": STEPS, "batch": BATCH,
                     "config": _config(stage, offload, str(tmp_path / f"swap-{name}"))})
    res = run_ranks_ok("dist_child.py", {"runs": runs}, tmp_path, world_size=2, timeout=300)
    out = tmp_path / [d for d in os.listdir(tmp_path) if d.startswith("ranks-")][0] / "rank0.json"
    ref_losses, ref_params = _reference(runs[0]["config"], round_moments=True)
    _, f32_params = _reference(runs[0]["config"], round_moments=False)
    for run in runs:
        name = run["name"]
        for r in res:
            got = r.result["runs"][name]
            for i, (a, b) in enumerate(zip(got["losses"], ref_losses, strict=True)):
                assert abs(a - b) <= 1e-5 * abs(b), f"{name} rank {r.rank} step {i}: {a} vs {b}"
            assert got["swap_left"] == []
        sd = load_file(f"{out}.{name}.safetensors")
        assert set(sd) == set(ref_params)
        to_bf16, to_fp32 = _rel(sd, ref_params), _rel(sd, f32_params)
        assert to_bf16 < 1e-4 and to_bf16 < 0.2 * to_fp32, (name, to_bf16, to_fp32)
        assert to_fp32 > 1e-6, (name, to_fp32)
