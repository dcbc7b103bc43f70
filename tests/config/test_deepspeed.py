"""InfinityConfig.from_deepspeed on realistic DeepSpeed configs, and its rejections."""
import copy
import json
import logging
import math

import pytest

from infinity.config import ConfigError, InfinityConfig
from infinity.optim.schedule import lr_at

# The ZeRO-Infinity example of DeepSpeed's docs (config-json "ZeRO-Infinity" / the
# "ZeRO-Infinity" tutorial), plus the usual surrounding keys.
ZERO_INFINITY = {
    "train_batch_size": 64,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "wall_clock_breakdown": False,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam",
                  "params": {"lr": 1e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupDecayLR",
                  "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-4, "warmup_num_steps": 100,
                             "total_num_steps": 2000, "warmup_type": "linear"}},
    "zero_optimization": {
        "stage": 3,
        "contiguous_gradients": True,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
        "stage3_prefetch_bucket_size": 1e7,
        "stage3_param_persistence_threshold": 1e5,
        "reduce_bucket_size": 1e7,
        "sub_group_size": 1e9,
        "overlap_comm": True,
        "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                              "buffer_count": 4, "fast_init": False},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme", "pin_memory": True,
                          "buffer_count": 5, "buffer_size": 1e8, "max_in_cpu": 1e9},
        "stage3_gather_16bit_weights_on_model_save": True,
    },
    "aio": {"block_size": 262144, "queue_depth": 32, "thread_count": 1,
            "single_submit": False, "overlap_events": True},
}


def test_zero_infinity_translation(caplog):
    with caplog.at_level(logging.INFO, logger="infinity.config"):
        c = InfinityConfig.from_deepspeed(ZERO_INFINITY)
    assert c.zero_stage == 3 and c.precision == "bf16"
    assert (c.offload.params, c.offload.optimizer) == ("nvme", "nvme")
    assert c.offload.nvme_paths == ["/local_nvme"]
    assert (c.aio.block_size, c.aio.queue_depth, c.aio.threads) == (262144, 32, 1)
    # DeepSpeed "Adam" with the default adam_w_mode=True is AdamW
    assert c.optimizer.type == "adamw"
    assert c.optimizer.lr == 1e-4 and c.optimizer.betas == (0.9, 0.95)
    assert c.optimizer.weight_decay == 0.01 and c.optimizer.eps == 1e-8
    assert (c.scheduler.type, c.scheduler.warmup_steps, c.scheduler.total_steps) == \
        ("linear", 100, 2000)
    assert c.gradient_clipping == 1.0 and c.gradient_accumulation_steps == 2
    assert c.reduce_bucket_mb == 20.0       # 1e7 elements of bf16
    # untranslated keys keep infinity's defaults
    assert c.prefetch.depth == 2 and c.aio.engine == "auto"
    # one info line lists every ignored key
    lines = [r.getMessage() for r in caplog.records if "accepted but ignored" in r.getMessage()]
    assert len(lines) == 1
    for k in ["train_batch_size", "zero_optimization.sub_group_size",
              "zero_optimization.stage3_prefetch_bucket_size", "zero_optimization.overlap_comm",
              "zero_optimization.offload_param.pin_memory",
              "zero_optimization.offload_param.buffer_count", "aio.single_submit"]:
        assert k in lines[0]


def test_from_deepspeed_json_and_yaml_files(tmp_path):
    p = tmp_path / "ds_config.json"
    p.write_text(json.dumps(ZERO_INFINITY))
    assert InfinityConfig.from_deepspeed(str(p)) == InfinityConfig.from_deepspeed(ZERO_INFINITY)
    import yaml
    y = tmp_path / "ds_config.yaml"
    y.write_text(yaml.safe_dump(ZERO_INFINITY))
    assert InfinityConfig.from_deepspeed(y) == InfinityConfig.from_deepspeed(ZERO_INFINITY)


def test_cpu_offload_fp16_and_adam_l2():
    ds = {
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 0.25},
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "adam_w_mode": False}},
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu",
                                                                 "pin_memory": True}},
    }
    c = InfinityConfig.from_deepspeed(ds)
    assert c.precision == "fp16" and c.zero_stage == 2
    assert c.fp16.initial_scale == 4096.0 and c.fp16.growth_interval == 500
    assert c.fp16.min_scale == 0.25
    assert (c.offload.params, c.offload.optimizer) == ("none", "cpu")
    assert c.offload.nvme_paths == ["./infinity-swap"]  # nvme not used: untouched
    assert c.optimizer.type == "adam" and c.optimizer.lr == 3e-4


def test_small_translations():
    c = InfinityConfig.from_deepspeed({})
    assert c.zero_stage == 1 and c.precision == "fp32"  # DeepSpeed's stage 0 -> 1
    c = InfinityConfig.from_deepspeed({"optimizer": {"type": "AdamW",
                                                     "params": {"adam_w_mode": False}}})
    assert c.optimizer.type == "adamw"  # AdamW is always decoupled
    c = InfinityConfig.from_deepspeed({"zero_optimization": {"stage": 1, "cpu_offload": True}})
    assert c.offload.optimizer == "cpu"
    c = InfinityConfig.from_deepspeed({"zero_optimization": {"stage": 3,
                                                             "cpu_offload_params": True}})
    assert (c.offload.params, c.offload.optimizer) == ("cpu", "none")
    c = InfinityConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/a"},
        "offload_optimizer": {"device": "nvme", "nvme_path": "/b"}}})
    assert c.offload.nvme_paths == ["/a", "/b"]
    c = InfinityConfig.from_deepspeed({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme"}}})
    assert c.offload.nvme_paths == ["/local_nvme"]  # DeepSpeed's default nvme_path


def _ds_warmup_lr(it, wmin, wmax, warm, total=None):
    """DeepSpeed's WarmupLR / WarmupDecayLR (warmup_type linear) at last_batch_iteration=it,
    transcribed from deepspeed/runtime/lr_schedules.py."""
    warm = max(2, warm)
    if it < warm:
        gamma = it / warm
    elif total is None:
        gamma = 1.0
    else:
        gamma = max(0.0, (total - it) / max(1.0, total - warm))
    return wmin + (wmax - wmin) * gamma


def test_warmup_lr_schedules_are_exact():
    for warm in (0, 1, 5):
        ds = {"scheduler": {"type": "WarmupLR", "params": {
            "warmup_min_lr": 0, "warmup_max_lr": 5e-4, "warmup_num_steps": warm,
            "warmup_type": "linear"}}}
        c = InfinityConfig.from_deepspeed(ds)
        assert c.scheduler.type == "constant" and c.optimizer.lr == 5e-4
        for it in range(20):
            assert lr_at(it, c.optimizer.lr, c.scheduler) == pytest.approx(
                _ds_warmup_lr(it, 0.0, 5e-4, warm), abs=1e-15)
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1.0}},
          "scheduler": {"type": "WarmupDecayLR", "params": {
              "warmup_max_lr": 2e-4, "warmup_num_steps": 7, "total_num_steps": 40,
              "warmup_type": "linear"}}}
    c = InfinityConfig.from_deepspeed(ds)
    assert c.optimizer.lr == 2e-4  # warmup_max_lr is the peak, as in DeepSpeed
    for it in range(50):
        assert lr_at(it, c.optimizer.lr, c.scheduler) == pytest.approx(
            _ds_warmup_lr(it, 0.0, 2e-4, 7, 40), abs=1e-15)


def test_warmup_cosine_only_when_approximate(caplog):
    ds = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupCosineLR", "params": {
              "total_num_steps": 100, "warmup_num_steps": 10, "cos_min_ratio": 0.1,
              "warmup_type": "linear"}}}
    with pytest.raises(ConfigError, match="one step ahead.*approximate_schedules=True"):
        InfinityConfig.from_deepspeed(ds)
    with caplog.at_level(logging.WARNING, logger="infinity.config"):
        c = InfinityConfig.from_deepspeed(ds, approximate_schedules=True)
    assert any("one step ahead" in r.getMessage() for r in caplog.records)
    assert c.scheduler.type == "cosine" and c.scheduler.min_lr == pytest.approx(1e-4)
    assert (c.scheduler.warmup_steps, c.scheduler.total_steps) == (10, 100)
    # DeepSpeed's cosine ratio at iteration it equals ours at it + 1 (the documented shift)
    for it in range(10, 99):
        ds_ratio = 0.1 + 0.9 * (1 + math.cos(math.pi * (it - 10 + 1) / 90)) / 2
        assert lr_at(it + 1, 1e-3, c.scheduler) == pytest.approx(1e-3 * ds_ratio)


def test_log_warmup_rejected_unless_approximate():
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}
    with pytest.raises(ConfigError, match='scheduler.params.warmup_type: .*"log".*"linear"'):
        InfinityConfig.from_deepspeed(ds)
    c = InfinityConfig.from_deepspeed(ds, approximate_schedules=True)
    assert c.scheduler.warmup_steps == 10 and c.optimizer.lr == 0.001


REJECT = [
    (lambda d: d["zero_optimization"].__setitem__("stage3_prefetch_bucket_size", "auto"),
     ["zero_optimization.stage3_prefetch_bucket_size", '"auto"', "concrete value"]),
    (lambda d: d["optimizer"]["params"].__setitem__("lr", "auto"),
     ["optimizer.params.lr", '"auto"']),
    (lambda d: d["zero_optimization"].__setitem__("zero_quantized_weights", "yes"),
     ["zero_pp.quantized_weights", "true or false",
      "DeepSpeed key zero_optimization.zero_quantized_weights"]),
    (lambda d: d["zero_optimization"].__setitem__("zero_hpz_partition_size", 0),
     ["zero_pp.hpz_partition_size", "DeepSpeed key zero_optimization.zero_hpz_partition_size"]),
    (lambda d: d["zero_optimization"].__setitem__("zero_quantized_nontrainable_weights", True),
     ["zero_optimization.zero_quantized_nontrainable_weights", "not supported"]),
    (lambda d: d["zero_optimization"].__setitem__("stage3_fancy_mode", 1),
     ["zero_optimization.stage3_fancy_mode", "unknown or unsupported"]),
    (lambda d: d["zero_optimization"].__setitem__("overlap_com", True),
     ["zero_optimization.overlap_com", "did you mean zero_optimization.overlap_comm"]),
    (lambda d: d["zero_optimization"]["offload_optimizer"].__setitem__("ratio", 0.3),
     ["zero_optimization.offload_optimizer.ratio", "partial"]),
    (lambda d: d["zero_optimization"]["offload_param"].__setitem__("device", "disk"),
     ["zero_optimization.offload_param.device", '"disk"']),
    (lambda d: d["zero_optimization"].__setitem__("stage", 2),
     ["offload.params", "zero_stage 3", "DeepSpeed key zero_optimization.offload_param.device"]),
    (lambda d: d["aio"].__setitem__("block_size", 1000),
     ["aio.block_size", "power of two", "DeepSpeed key aio.block_size"]),
    (lambda d: d["aio"].__setitem__("use_gds", True), ["aio.use_gds", "GPUDirect"]),
    (lambda d: d["optimizer"].__setitem__("type", "Lamb"), ["optimizer.type", '"Lamb"']),
    (lambda d: d["optimizer"]["params"].__setitem__("amsgrad", True),
     ["optimizer.params.amsgrad"]),
    (lambda d: d["optimizer"]["params"].__setitem__("betas", [0.9, 1.5]),
     ["optimizer.betas[1]", "DeepSpeed key optimizer.params.betas"]),
    (lambda d: d["scheduler"].__setitem__("type", "OneCycle"),
     ["scheduler.type", '"OneCycle"', "WarmupLR"]),
    (lambda d: d["scheduler"]["params"].__setitem__("warmup_min_lr", 1e-6),
     ["scheduler.params.warmup_min_lr", "from lr 0"]),
    (lambda d: d["scheduler"]["params"].__setitem__("total_num_steps", 50),
     ["scheduler.total_steps", "greater than", "DeepSpeed key scheduler.params.total_num_steps"]),
    (lambda d: d["fp16"].__setitem__("enabled", True), ["fp16.enabled", "only one"]),
    (lambda d: (d["bf16"].__setitem__("enabled", False), d["fp16"].update(enabled=True,
                                                                          loss_scale=128)),
     ["fp16.loss_scale", "static loss scale"]),
    (lambda d: d.__setitem__("amp", {"enabled": True}), ["amp.enabled"]),
    (lambda d: d.__setitem__("activation_checkpointing", {"partition_activations": True}),
     ["activation_checkpointing", "torch.utils.checkpoint"]),
    (lambda d: d.__setitem__("communication_data_type", "fp16"), ["communication_data_type"]),
    (lambda d: d.__setitem__("pipeline", {"stages": 2}), ["DeepSpeed pipeline", "unknown"]),
    (lambda d: d.__setitem__("gradient_cliping", 1.0),
     ["DeepSpeed gradient_cliping", "did you mean gradient_clipping?"]),
    (lambda d: d.__setitem__("gradient_accumulation_steps", 0),
     ["gradient_accumulation_steps", ">= 1"]),
]


@pytest.mark.parametrize("mutate,parts", REJECT, ids=[r[1][0] for r in REJECT])
def test_rejections_name_the_deepspeed_key(mutate, parts):
    ds = copy.deepcopy(ZERO_INFINITY)
    ds.setdefault("fp16", {"enabled": False})
    mutate(ds)
    with pytest.raises(ConfigError) as ei:
        InfinityConfig.from_deepspeed(ds)
    for p in parts:
        assert p in str(ei.value), f"{p!r} not in {str(ei.value)!r}"


def test_gradient_accumulation_not_derived_warns(caplog):
    with caplog.at_level(logging.WARNING, logger="infinity.config"):
        c = InfinityConfig.from_deepspeed({"train_batch_size": 32,
                                           "train_micro_batch_size_per_gpu": 4})
    assert c.gradient_accumulation_steps == 1
    assert any("gradient_accumulation_steps explicitly" in r.getMessage() for r in caplog.records)


def test_not_a_mapping():
    with pytest.raises(ConfigError, match="mapping"):
        InfinityConfig.from_deepspeed([1, 2])


def test_bf16_check_grad_overflow_translates_to_skip():
    c = InfinityConfig.from_deepspeed({"bf16": {"enabled": True, "check_grad_overflow": True}})
    assert c.precision == "bf16" and c.nonfinite_grads == "skip"
    with pytest.raises(ConfigError, match="check_grad_overflow"):
        InfinityConfig.from_deepspeed({"bf16": {"enabled": True, "check_grad_overflow": "yes"}})


def test_frozen_weights_extension_in_offload_param():
    """infinity's own key in a DeepSpeed config: ``zero_optimization.offload_param.
    frozen_weights`` becomes ``offload.frozen_weights`` (a LoRA base kept quantized), its
    values checked as infinity's; in offload_optimizer it stays an unknown key."""
    from infinity.config import ConfigError, InfinityConfig
    ds = {"zero_optimization": {"stage": 3, "offload_param": {
        "device": "cpu", "frozen_weights": {"dtype": "nf4", "double_quant": True}}}}
    fw = InfinityConfig.from_deepspeed(ds).offload.frozen_weights
    assert (fw.dtype, fw.group_size, fw.double_quant) == ("nf4", 64, True)
    ds["zero_optimization"]["offload_param"]["frozen_weights"] = {"dtype": "fp8"}
    with pytest.raises(ConfigError, match=r"offload\.frozen_weights\.dtype"):
        InfinityConfig.from_deepspeed(ds)
    with pytest.raises(ConfigError, match=r"offload_optimizer\.frozen_weights"):
        InfinityConfig.from_deepspeed({"zero_optimization": {"stage": 3, "offload_optimizer": {
            "device": "cpu", "frozen_weights": {"dtype": "nf4"}}}})
