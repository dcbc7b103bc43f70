"""DeepSpeed configs with "auto": InfinityConfig.from_deepspeed(cfg, training_args=...) fills
what the Hugging Face DeepSpeed integration fills, mismatches name both values, "auto"
without arguments stays an error; and the Trainer run from such a ds_config.json equals the
run from the explicit config."""
import copy
import json
import logging
import math
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hf_helpers as H  # noqa: E402

transformers = pytest.importorskip("transformers")

from infinity.config import ConfigError, InfinityConfig  # noqa: E402
from infinity.config_deepspeed import DS_AUTO_KEYS  # noqa: E402


def hf_zero3(nvme):
    """The ZeRO-3 NVMe example of the transformers DeepSpeed docs: "auto" everywhere."""
    return {
        "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
                 "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
        "bf16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                  "weight_decay": "auto"}},
        "scheduler": {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto",
            "total_num_steps": "auto", "warmup_type": "linear"}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True,
                                  "buffer_count": 4, "fast_init": False},
            "offload_param": {"device": "nvme", "nvme_path": str(nvme), "pin_memory": True,
                              "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
            "overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9,
            "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
            "stage3_param_persistence_threshold": "auto", "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9, "stage3_gather_16bit_weights_on_model_save": True},
        "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
                "single_submit": False, "overlap_events": True},
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
        "steps_per_print": 2000, "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
    }


def test_every_auto_the_hf_integration_fills_is_filled(tmp_path, caplog):
    import inspect

    from transformers.integrations import deepspeed as hfds
    src = inspect.getsource(hfds.HfTrainerDeepSpeedConfig.trainer_config_process) + \
        inspect.getsource(hfds.HfTrainerDeepSpeedConfig.trainer_config_finalize)
    import re
    hf_keys = set(re.findall(r'"((?:[a-z0-9_]+\.)*[a-z0-9_]+)"', src))
    hf_keys = {k for k in hf_keys if k in DS_AUTO_KEYS or "." in k or k in (
        "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size",
        "gradient_clipping")}
    hf_keys -= {"checkpoint.use_node_local_storage"}
    assert hf_keys <= set(DS_AUTO_KEYS), hf_keys - set(DS_AUTO_KEYS)

    args = H.args(tmp_path, weight_decay=0.05, adam_beta2=0.98, adam_epsilon=1e-7,
                  max_grad_norm=0.7, gradient_accumulation_steps=4, bf16=True)
    with caplog.at_level(logging.INFO, logger="infinity.config"):
        c = InfinityConfig.from_deepspeed(hf_zero3(tmp_path / "nv"), training_args=args,
                                          num_training_steps=100, model=H.gpt2(),
                                          approximate_schedules=True)
    assert c.optimizer.lr == args.learning_rate and c.optimizer.betas == (0.9, 0.98)
    assert c.optimizer.eps == 1e-7 and c.optimizer.weight_decay == 0.05
    assert c.gradient_clipping == 0.7 and c.gradient_accumulation_steps == 4
    assert c.precision == "bf16"
    assert (c.scheduler.type, c.scheduler.warmup_steps, c.scheduler.total_steps) == \
        ("linear", 3, 100)
    assert (c.offload.params, c.offload.optimizer) == ("nvme", "nvme")
    ignored = [r.getMessage() for r in caplog.records if "accepted but ignored" in r.getMessage()]
    # "auto" is hidden_size**2 elements (this GPT-2: 32), here in bf16
    assert c.reduce_bucket_mb == pytest.approx(32 * 32 * 2 / 1e6)
    assert len(ignored) == 1 and "zero_optimization.reduce_bucket_size" not in ignored[0]
    assert "train_batch_size" in ignored[0]


def test_auto_without_training_args_and_mismatches(tmp_path):
    with pytest.raises(ConfigError, match=r'fp16\.enabled: "auto".*training_args=args'):
        InfinityConfig.from_deepspeed(hf_zero3(tmp_path))
    args = H.args(tmp_path)
    ds = hf_zero3(tmp_path)
    ds["optimizer"]["params"]["lr"] = 1e-4
    ds["gradient_accumulation_steps"] = 8
    with pytest.raises(ConfigError) as ei:
        InfinityConfig.from_deepspeed(ds, training_args=args, num_training_steps=10)
    msg = str(ei.value)
    assert "ds optimizer.params.lr=0.0001 vs hf learning_rate=0.003" in msg
    assert "ds gradient_accumulation_steps=8 vs hf gradient_accumulation_steps=2" in msg
    ds = hf_zero3(tmp_path)
    with pytest.raises(ConfigError, match="total_num_steps.*num_training_steps"):
        InfinityConfig.from_deepspeed(ds, training_args=H.args(tmp_path, max_steps=-1))


def _run(tmp_path, name, cfg, **kw):
    from infinity.integrations.transformers import InfinityTrainer
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / name, **kw),
                         train_dataset=H.TokenData(), infinity_config=cfg)
    try:
        tr.train()
        sd = {k: v.clone() for k, v in tr.engine.state_dict().items()}
        return H.losses(tr), H.log_values(tr, "learning_rate"), sd, tr.engine.cfg
    finally:
        tr.close()


def test_ds_config_with_auto_runs_like_the_explicit_config(tmp_path):
    """ds_config.json (HF's ZeRO-3 NVMe example, "auto" everywhere, WarmupDecayLR linear)
    through InfinityTrainer == the explicit infinity config with the Trainer's linear
    schedule (the same lr curve): same losses, lrs and weights."""
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(hf_zero3(tmp_path / "nv1")))
    a_loss, a_lr, a_sd, a_cfg = _run(tmp_path, "ds", str(p))
    explicit = H.nvme_config(tmp_path / "nv2", aio={"block_size": 262144})
    b_loss, b_lr, b_sd, _ = _run(tmp_path, "explicit", explicit)
    assert (a_cfg.offload.params, a_cfg.offload.optimizer, a_cfg.zero_stage) == \
        ("nvme", "nvme", 3)
    assert a_cfg.offload.nvme_paths == [str(tmp_path / "nv1")]
    assert a_lr == pytest.approx(b_lr, rel=1e-12, abs=1e-15)
    assert len(a_loss) == 10 and a_loss == pytest.approx(b_loss, rel=1e-6)
    for k in b_sd:
        assert float((a_sd[k] - b_sd[k]).norm()) <= 1e-6 * float(b_sd[k].norm()) + 1e-12, k


def test_ds_log_warmup_is_deepspeeds(tmp_path):
    """HF's documented WarmupLR with DeepSpeed's default "log" warmup: the exact DeepSpeed
    curve (lr * log(it+1)/log(warm) during warmup, then lr)."""
    ds = hf_zero3(tmp_path / "nv")
    ds["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                      "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto"}}
    _, lrs, _, _ = _run(tmp_path, "log", ds, max_steps=6, warmup_steps=4)
    lr, warm = 3e-3, 4
    want = [lr * (math.log(it + 1) / math.log(warm) if it < warm else 1.0) for it in range(6)]
    assert lrs == pytest.approx(want, rel=1e-9, abs=1e-15)


def test_ds_config_contradiction_at_train(tmp_path):
    from infinity.integrations.transformers import InfinityTrainer
    ds = copy.deepcopy(hf_zero3(tmp_path / "nv"))
    ds["gradient_clipping"] = 0.3
    tr = InfinityTrainer(model=H.gpt2(), args=H.args(tmp_path / "o"), train_dataset=H.TokenData(),
                         infinity_config=ds)
    try:
        with pytest.raises(ConfigError, match="ds gradient_clipping=0.3 vs hf max_grad_norm=1.0"):
            tr.train()
    finally:
        tr.close()


def test_ds_schedule_factors():
    """The DeepSpeed schedules the Trainer path uses, against DeepSpeed's formulas (as
    transcribed in tests/config/test_deepspeed.py): WarmupDecayLR (linear and log warmup,
    warmup clamped to >= 2) and WarmupCosineLR (cosine phase at it - warm + 1)."""
    from infinity.integrations.trainer_config import ds_schedule_lambda
    lr = 2e-4
    f = ds_schedule_lambda({"type": "WarmupDecayLR", "params": {
        "warmup_min_lr": 0, "warmup_max_lr": lr, "warmup_num_steps": 7, "total_num_steps": 40,
        "warmup_type": "linear"}}, lr)
    for it in range(45):
        g = it / 7 if it < 7 else max(0.0, (40 - it) / 33)
        assert f(it) == pytest.approx(g, abs=1e-12)
    f = ds_schedule_lambda({"type": "WarmupLR", "params": {"warmup_num_steps": 1,
                                                           "warmup_max_lr": lr}}, lr)
    assert [f(i) for i in range(3)] == pytest.approx([0.0, math.log(2) / math.log(2), 1.0])
    f = ds_schedule_lambda({"type": "WarmupCosineLR", "params": {
        "total_num_steps": 100, "warmup_num_steps": 10, "cos_min_ratio": 0.1,
        "warmup_type": "linear"}}, lr)
    for it in range(100):
        want = it / 10 if it < 10 else 0.1 + 0.9 * (1 + math.cos(math.pi * (it - 10 + 1) / 90)) / 2
        assert f(it) == pytest.approx(want, abs=1e-12)
    with pytest.raises(ConfigError, match="OneCycle"):
        ds_schedule_lambda({"type": "OneCycle", "params": {}}, lr)
