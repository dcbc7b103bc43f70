"""Translation of a DeepSpeed JSON config into an infinity config dict.

Used by :meth:`infinity.config.InfinityConfig.from_deepspeed`; the mapping, what is
ignored and what is rejected are documented in docs/migrating-from-deepspeed.md.
"""
from __future__ import annotations

import difflib
import logging
import os
from typing import Any, Mapping

from infinity.config_sections import (OFFLOAD_HOMES, ConfigError, OptimizerConfig, parse_float, fmt_value,
                                      parse_int)

log = logging.getLogger("infinity.config")

__all__ = ["deepspeed_to_dict", "fill_auto", "DS_AUTO_KEYS", "DS_IGNORED_TOP_KEYS",
           "DS_IGNORED_ZERO_KEYS",
           "DS_IGNORED_OFFLOAD_KEYS", "DS_IGNORED_AIO_KEYS"]

# Keys that only tune DeepSpeed's own buffers/overlap: accepted, ignored, listed in one log.
DS_IGNORED_ZERO_KEYS = (
    "contiguous_gradients", "overlap_comm", "reduce_scatter",
    "allgather_partitions", "allgather_bucket_size", "round_robin_gradients",
    "sub_group_size", "stage3_prefetch_bucket_size", "prefetch_bucket_size",
    "stage3_param_persistence_threshold", "param_persistence_threshold",
    "stage3_model_persistence_threshold", "model_persistence_threshold",
    "stage3_max_live_parameters", "max_live_parameters",
    "stage3_max_reuse_distance", "max_reuse_distance",
    "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
    "gather_16bit_weights_on_model_save", "elastic_checkpoint", "load_from_fp32_weights",
    "ignore_unused_parameters", "memory_efficient_linear", "use_all_reduce_for_fetch_params",
    "module_granularity_threshold", "log_trace_cache_warnings", "cpu_offload_use_pin_memory",
)
DS_IGNORED_OFFLOAD_KEYS = ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu",
                           "fast_init", "pipeline_read", "pipeline_write", "pipeline")
DS_IGNORED_AIO_KEYS = ("single_submit", "overlap_events", "intra_op_parallelism")
DS_IGNORED_TOP_KEYS = (
    "train_batch_size", "train_micro_batch_size_per_gpu", "steps_per_print",
    "wall_clock_breakdown", "memory_breakdown", "dump_state", "prescale_gradients",
    "gradient_predivide_factor", "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
    "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet", "comms_logger",
    "monitor_config", "checkpoint", "seed",
)
DS_DEFAULT_NVME_PATH = "/local_nvme"  # DeepSpeed's documented default for nvme_path


def _ds_err(key: str, msg: str) -> ConfigError:
    return ConfigError(f"DeepSpeed {key}: {msg}")


def _ds_find_auto(obj: Any, prefix: str = "") -> None:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            _ds_find_auto(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _ds_find_auto(v, f"{prefix}[{i}]")
    elif isinstance(obj, str) and obj.strip().lower() == "auto":
        raise _ds_err(prefix, '"auto" is filled in from the Hugging Face TrainingArguments: '
                              'pass them (InfinityConfig.from_deepspeed(cfg, '
                              'training_args=args), or use infinity.integrations.transformers.'
                              'InfinityTrainer), or replace it with a concrete value (or '
                              'delete the key to use the default)')


# Every "auto" the Hugging Face Trainer's DeepSpeed integration fills
# (transformers.integrations.deepspeed.HfTrainerDeepSpeedConfig.trainer_config_process and
# trainer_config_finalize), in its order: DeepSpeed key -> (what fills it, checked against
# TrainingArguments when the value is explicit?)
DS_AUTO_KEYS = {
    "train_micro_batch_size_per_gpu": ("per_device_train_batch_size", True),
    "gradient_accumulation_steps": ("gradient_accumulation_steps", True),
    "train_batch_size": ("train_batch_size (calculated)", True),
    "gradient_clipping": ("max_grad_norm", True),
    "optimizer.params.lr": ("learning_rate", True),
    "optimizer.params.betas": ("adam_beta1+adam_beta2", True),
    "optimizer.params.eps": ("adam_epsilon", True),
    "optimizer.params.weight_decay": ("weight_decay", True),
    "scheduler.params.warmup_min_lr": ("0 (not a trainer arg)", False),
    "scheduler.params.warmup_max_lr": ("learning_rate", True),
    "fp16.enabled": ("fp16|fp16_full_eval", True),
    "bf16.enabled": ("bf16|bf16_full_eval", True),
    "zero_optimization.reduce_bucket_size": ("hidden_size*hidden_size", False),
    "zero_optimization.stage3_prefetch_bucket_size": ("0.9*hidden_size*hidden_size", False),
    "zero_optimization.stage3_param_persistence_threshold": ("10*hidden_size", False),
    "scheduler.params.total_num_steps": ("num_training_steps (calculated)", True),
    "scheduler.params.warmup_num_steps": ("warmup_steps", True),
}


def _hidden_size(model) -> int | None:
    cfg = getattr(model, "config", None)
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        if getattr(c, "hidden_size", None):
            return int(c.hidden_size)
        if getattr(c, "hidden_sizes", None):
            return int(max(c.hidden_sizes))
    return None


def _world_size(args) -> int:
    ws = getattr(args, "world_size", None)
    if isinstance(ws, int) and ws >= 1:
        return ws
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def fill_auto(ds: Mapping, training_args, *, num_training_steps: int | None = None,
              model=None) -> tuple[dict, list[str]]:
    """Fill every ``"auto"`` of a DeepSpeed config from Hugging Face ``TrainingArguments``
    the way ``HfTrainerDeepSpeedConfig`` does, and check the explicit values it checks.

    Returns ``(filled copy, filled keys)``; an explicit value that contradicts
    ``training_args`` raises :class:`ConfigError` listing every mismatch as
    ``ds <key>=<value> vs hf <argument>=<value>``.  ``scheduler.params.total_num_steps``
    needs ``num_training_steps`` (else ``training_args.max_steps`` when > 0); the three
    hidden-size keys take the model's ``config.hidden_size`` when a model is given (they
    only tune DeepSpeed's buffers, which infinity ignores either way)."""
    import copy
    args = training_args
    out = copy.deepcopy(dict(ds))
    filled: list[str] = []
    mismatches: list[str] = []
    if num_training_steps is None and getattr(args, "max_steps", -1) and args.max_steps > 0:
        num_training_steps = int(args.max_steps)
    hidden = _hidden_size(model) if model is not None else None
    zero3 = isinstance(out.get("zero_optimization"), Mapping) and \
        out["zero_optimization"].get("stage") == 3
    warm = None
    if num_training_steps is not None and hasattr(args, "get_warmup_steps"):
        warm = max(1, int(args.get_warmup_steps(num_training_steps)))
    values = {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
        "train_batch_size": _world_size(args) * args.per_device_train_batch_size
        * args.gradient_accumulation_steps,
        "gradient_clipping": args.max_grad_norm,
        "optimizer.params.lr": args.learning_rate,
        "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
        "optimizer.params.eps": args.adam_epsilon,
        "optimizer.params.weight_decay": args.weight_decay,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": args.learning_rate,
        "fp16.enabled": bool(args.fp16 or getattr(args, "fp16_full_eval", False)),
        "bf16.enabled": bool(args.bf16 or getattr(args, "bf16_full_eval", False)),
        "zero_optimization.reduce_bucket_size": hidden * hidden if hidden else None,
        "zero_optimization.stage3_prefetch_bucket_size":
            int(0.9 * hidden * hidden) if hidden and zero3 else None,
        "zero_optimization.stage3_param_persistence_threshold":
            10 * hidden if hidden and zero3 else None,
        "scheduler.params.total_num_steps": num_training_steps,
        "scheduler.params.warmup_num_steps": warm,
    }
    for key, (hf_key, must_match) in DS_AUTO_KEYS.items():
        *parents, leaf = key.split(".")
        node = out
        for p_ in parents:
            nxt = node.get(p_) if isinstance(node, Mapping) else None
            if not isinstance(nxt, Mapping):
                node = None
                break
            node[p_] = nxt = dict(nxt)
            node = nxt
        if node is None or leaf not in node:
            continue
        hf_val = values[key]
        if isinstance(node[leaf], str) and node[leaf].strip().lower() == "auto":
            if hf_val is None:
                if key.startswith("zero_optimization."):
                    del node[leaf]        # tuning-only: nothing to fill it from, nothing lost
                    filled.append(key)
                    continue
                raise _ds_err(key, f'"auto" needs {hf_key}: pass num_training_steps= (the '
                                   f'number of optimizer updates) or set max_steps in the '
                                   f'TrainingArguments')
            node[leaf] = hf_val
            filled.append(key)
            continue
        if must_match and hf_val is not None and node[leaf] is not None:
            ds_val = node[leaf]
            same = ds_val == hf_val or (isinstance(ds_val, (list, tuple)) and
                                        list(ds_val) == list(hf_val))
            if not same:
                mismatches.append(f"- ds {key}={ds_val} vs hf {hf_key}={hf_val}")
    if mismatches:
        raise ConfigError("DeepSpeed config values that contradict the TrainingArguments:\n"
                          + "\n".join(mismatches) + "\nset these DeepSpeed values to \"auto\" "
                          "(or to the TrainingArguments' values)")
    if filled:
        log.info('DeepSpeed "auto" values filled from the TrainingArguments: %s',
                 ", ".join(filled))
    return out, filled


def _ds_section(ds: Mapping, key: str, prefix: str = "") -> Mapping:
    v = ds.get(key)
    if v is None:
        return {}
    if not isinstance(v, Mapping):
        raise _ds_err(prefix + key, f"expected a mapping, got {fmt_value(v)}")
    return v


def _ds_bool(sec: Mapping, key: str, default: bool, where: str) -> bool:
    v = sec.get(key, default)
    if not isinstance(v, bool):
        raise _ds_err(f"{where}.{key}", f"expected true or false, got {fmt_value(v)}")
    return v


def _ds_unknown(sec: Mapping, known: tuple, where: str) -> None:
    for k in sec:
        if k not in known:
            close = difflib.get_close_matches(str(k), list(known), n=1, cutoff=0.6)
            hint = (f"did you mean {where + '.' if where else ''}{close[0]}?" if close else
                    "infinity cannot honour it; remove it (see docs/migrating-from-deepspeed.md)")
            raise _ds_err(f"{where}.{k}" if where else str(k), f"unknown or unsupported key; {hint}")


def _ds_device(sec: Mapping, where: str) -> str:
    dev = sec.get("device", "none")
    dev = "none" if dev is None else dev
    if not isinstance(dev, str) or dev.lower() not in OFFLOAD_HOMES:
        raise _ds_err(f"{where}.device", f'expected "none", "cpu" or "nvme", got {fmt_value(dev)}')
    return dev.lower()


class _Translation:
    """One DeepSpeed config being translated: the infinity dict, the DeepSpeed key each
    infinity key came from, the DeepSpeed keys accepted but ignored."""

    def __init__(self, approximate_schedules: bool):
        self.out: dict = {}
        self.origin: dict[str, str] = {}
        self.ignored: list[str] = []
        self.approximate = approximate_schedules

    def put(self, ikey: str, value: Any, dskey: str) -> None:
        node = self.out
        parts = ikey.split(".")
        for p_ in parts[:-1]:
            node = node.setdefault(p_, {})
        node[parts[-1]] = value
        self.origin[ikey] = dskey

    def copy(self, sec: Mapping, where: str, table) -> None:
        """The one-to-one keys of ``table`` (``(DeepSpeed key, infinity key)``) present in
        ``sec`` (the DeepSpeed section at ``where``), values as given (checked by
        :class:`infinity.config.InfinityConfig`)."""
        for dk, ik in table:
            if dk in sec:
                self.put(ik, sec[dk], f"{where}{dk}")


#: the DeepSpeed keys that translate one to one (values checked by InfinityConfig)
_ZEROPP_KEYS = (("zero_quantized_weights", "zero_pp.quantized_weights"),
                ("zero_hpz_partition_size", "zero_pp.hpz_partition_size"),
                ("zero_quantized_gradients", "zero_pp.quantized_gradients"))
_AIO_KEYS = (("block_size", "aio.block_size"), ("queue_depth", "aio.queue_depth"),
             ("thread_count", "aio.threads"))
_FP16_KEYS = (("loss_scale_window", "fp16.growth_interval"), ("min_loss_scale", "fp16.min_scale"))
_ADAM_KEYS = tuple((k, f"optimizer.{k}") for k in ("lr", "betas", "eps", "weight_decay"))
_LOOP_KEYS = (("gradient_clipping", "gradient_clipping"),
              ("gradient_accumulation_steps", "gradient_accumulation_steps"))
_KNOWN_TOP = ("zero_optimization", "aio", "optimizer", "scheduler", "fp16", "bf16", "bfloat16",
              "gradient_clipping", "gradient_accumulation_steps", "amp",
              "activation_checkpointing", "communication_data_type", "data_types",
              "sparse_gradients", "curriculum_learning") + DS_IGNORED_TOP_KEYS


def _features(ds: Mapping, t: _Translation) -> None:
    """What infinity does not have (refused, naming the fix) or does differently."""
    if _ds_section(ds, "amp").get("enabled", False):
        raise _ds_err("amp.enabled", "NVIDIA apex AMP is not supported; use "
                      '"bf16": {"enabled": true} or "fp16": {"enabled": true} instead')
    ac = _ds_section(ds, "activation_checkpointing")
    _ds_unknown(ac, ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization",
                     "number_checkpoints", "synchronize_checkpoint_boundary", "profile"),
                "activation_checkpointing")
    if _ds_bool(ac, "partition_activations", False, "activation_checkpointing"):
        raise _ds_err("activation_checkpointing.partition_activations", "partitioning activations "
                      "across model-parallel ranks is not provided (infinity has no model "
                      "parallelism); remove the key. Checkpoint with torch.utils.checkpoint (or "
                      "model.gradient_checkpointing_enable() for transformers models)")
    if _ds_bool(ac, "cpu_checkpointing", False, "activation_checkpointing"):
        # the checkpoint inputs live in host memory: torch.utils.checkpoint /
        # gradient_checkpointing_enable() mark the boundaries (not DeepSpeed's API)
        t.put("activation_offload.home", "cpu", "activation_checkpointing.cpu_checkpointing")
        t.put("activation_offload.scope", "checkpoints", "activation_checkpointing.cpu_checkpointing")
    t.ignored += [f"activation_checkpointing.{k}" for k in ac
                  if k not in ("partition_activations", "cpu_checkpointing")]
    cdt = ds.get("communication_data_type")
    if cdt not in (None, "fp32", "float32"):
        raise _ds_err("communication_data_type", f"infinity reduces gradients in fp32; got "
                      f"{fmt_value(cdt)}; remove the key")
    gad = _ds_section(ds, "data_types").get("grad_accum_dtype")
    _ds_unknown(_ds_section(ds, "data_types"), ("grad_accum_dtype",), "data_types")
    if gad in ("bf16", "bfloat16"):     # lossy, opted into: partial sums kept in bf16
        t.put("gradient_accumulation_dtype", "bf16", "data_types.grad_accum_dtype")
    elif gad not in (None, "fp32", "float32"):
        raise _ds_err("data_types.grad_accum_dtype", f"infinity accumulates gradients in fp32 "
                      f"or (when asked) bf16; got {fmt_value(gad)}; use \"fp32\" or \"bf16\"")
    if ds.get("sparse_gradients"):
        raise _ds_err("sparse_gradients", "sparse gradients are not supported; remove the key")


def _zero(ds: Mapping, t: _Translation) -> None:
    """``zero_optimization``: the stage, ZeRO++, the offload homes and NVMe paths."""
    zo = _ds_section(ds, "zero_optimization")
    zero_known = ("stage", "offload_param", "offload_optimizer", "cpu_offload", "cpu_offload_params",
                  "zero_hpz_partition_size", "zero_quantized_weights",
                  "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
                  "mics_shard_size", "mics_hierarchical_params_gather",
                  "reduce_bucket_size") + DS_IGNORED_ZERO_KEYS
    _ds_unknown(zo, zero_known, "zero_optimization")
    t.ignored += [f"zero_optimization.{k}" for k in zo if k in DS_IGNORED_ZERO_KEYS]
    for k, neutral in (("zero_quantized_nontrainable_weights", False), ("mics_shard_size", -1),
                       ("mics_hierarchical_params_gather", False)):
        if k in zo and zo[k] != neutral and not (k == "mics_shard_size" and zo[k] in (0, -1)):
            raise _ds_err(f"zero_optimization.{k}", f"got {fmt_value(zo[k])}: MiCS and quantized "
                          f"frozen weights are not supported (they change partitioning or "
                          f"numerics); remove the key")
    t.copy(zo, "zero_optimization.", _ZEROPP_KEYS)   # ZeRO++: validated by zero_pp
    stage = zo.get("stage", 0)
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise _ds_err("zero_optimization.stage", f"expected 0, 1, 2 or 3, got {fmt_value(stage)}")
    if stage == 0:
        log.info("DeepSpeed zero_optimization.stage 0 (no ZeRO) translated to zero_stage 1: "
                 "same numerics, optimizer states partitioned")
        stage = 1
    t.put("zero_stage", stage, "zero_optimization.stage")
    rbs = zo.get("reduce_bucket_size")
    if rbs is not None:   # elements -> MB of the working precision (Note [Gradient buckets])
        if isinstance(rbs, bool) or not isinstance(rbs, (int, float)) or rbs <= 0:
            raise _ds_err("zero_optimization.reduce_bucket_size",
                          f"expected a positive number of elements, got {fmt_value(rbs)}")
        half = any(_ds_bool(_ds_section(ds, k), "enabled", False, k)
                   for k in ("bf16", "bfloat16", "fp16") if k in ds)
        t.put("reduce_bucket_mb", float(rbs) * (2 if half else 4) / 1e6,
              "zero_optimization.reduce_bucket_size")

    nvme_paths: list[str] = []
    for which, ikey in (("offload_param", "params"), ("offload_optimizer", "optimizer")):
        where = f"zero_optimization.{which}"
        sec = _ds_section(zo, which, "zero_optimization.")
        # infinity's own extension: a frozen base kept quantized (offload.frozen_weights;
        # DeepSpeed has no such key, its values are checked as infinity's)
        extra = ("ratio",) if which == "offload_optimizer" else ("frozen_weights",)
        _ds_unknown(sec, ("device", "nvme_path") + extra + DS_IGNORED_OFFLOAD_KEYS, where)
        if "frozen_weights" in sec:
            t.put("offload.frozen_weights", sec["frozen_weights"], f"{where}.frozen_weights")
        t.ignored += [f"{where}.{k}" for k in sec if k in DS_IGNORED_OFFLOAD_KEYS]
        if "ratio" in sec and sec["ratio"] != 1 and sec["ratio"] != 1.0:
            raise _ds_err(f"{where}.ratio", f"partial optimizer offload ({fmt_value(sec['ratio'])}) is "
                          f"not supported; remove it (infinity offloads all optimizer states)")
        dev = _ds_device(sec, where)
        if sec:
            t.put(f"offload.{ikey}", dev, f"{where}.device")
        if dev == "nvme":
            path = sec.get("nvme_path", DS_DEFAULT_NVME_PATH)
            if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
                raise _ds_err(f"{where}.nvme_path", f"expected a directory path, got {fmt_value(path)}")
            path = os.fspath(path)
            if "nvme_path" not in sec:
                log.info("DeepSpeed %s.nvme_path not set: using DeepSpeed's default %s",
                         where, DS_DEFAULT_NVME_PATH)
            if path not in nvme_paths:
                nvme_paths.append(path)
            t.origin.setdefault("offload.nvme_paths", f"{where}.nvme_path")
    for legacy, ikey in (("cpu_offload", "optimizer"), ("cpu_offload_params", "params")):
        if legacy not in zo:
            continue
        if not isinstance(zo[legacy], bool):
            raise _ds_err(f"zero_optimization.{legacy}",
                          f"expected true or false, got {fmt_value(zo[legacy])}")
        if zo[legacy]:
            if t.out.get("offload", {}).get(ikey, "none") == "nvme":
                raise _ds_err(f"zero_optimization.{legacy}", "conflicts with an nvme offload "
                              "device; remove the legacy key")
            t.put(f"offload.{ikey}", "cpu", f"zero_optimization.{legacy}")
    if nvme_paths:
        t.put("offload.nvme_paths", nvme_paths, t.origin["offload.nvme_paths"])


def _aio(ds: Mapping, t: _Translation) -> None:
    aio = _ds_section(ds, "aio")
    _ds_unknown(aio, ("block_size", "queue_depth", "thread_count", "use_gds")
                + DS_IGNORED_AIO_KEYS, "aio")
    t.ignored += [f"aio.{k}" for k in aio if k in DS_IGNORED_AIO_KEYS]
    if aio.get("use_gds"):
        raise _ds_err("aio.use_gds", "GPUDirect Storage is not supported; remove the key "
                      "(infinity stages NVMe transfers through pinned host memory)")
    t.copy(aio, "aio.", _AIO_KEYS)


def _precision(ds: Mapping, t: _Translation) -> None:
    """``fp16`` / ``bf16``: the precision and the dynamic loss scale."""
    fp16 = _ds_section(ds, "fp16")
    bf16 = _ds_section(ds, "bf16") or _ds_section(ds, "bfloat16")
    _ds_unknown(fp16, ("enabled", "auto_cast", "loss_scale", "initial_scale_power",
                       "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                       "min_loss_scale", "fp16_master_weights_and_grads"), "fp16")
    _ds_unknown(bf16, ("enabled", "immediate_grad_update", "check_grad_overflow"), "bf16")
    fp16_on = _ds_bool(fp16, "enabled", False, "fp16")
    bf16_on = _ds_bool(bf16, "enabled", False, "bf16")
    if fp16_on and bf16_on:
        raise _ds_err("fp16.enabled", "both fp16 and bf16 are enabled; enable only one")
    if fp16_on:
        t.put("precision", "fp16", "fp16.enabled")
        if _ds_bool(fp16, "auto_cast", False, "fp16"):
            raise _ds_err("fp16.auto_cast", "autocast of inputs is not supported; remove it")
        if _ds_bool(fp16, "fp16_master_weights_and_grads", False, "fp16"):
            raise _ds_err("fp16.fp16_master_weights_and_grads", "infinity keeps fp32 master "
                          "weights; remove the key")
        ls = fp16.get("loss_scale", 0)
        if ls not in (0, 0.0):
            raise _ds_err("fp16.loss_scale", f"static loss scale {fmt_value(ls)} is not supported; "
                          f"use 0 (dynamic; tune initial_scale_power) or bf16")
        if "initial_scale_power" in fp16:
            p_ = parse_int("DeepSpeed fp16.initial_scale_power", fp16["initial_scale_power"],
                           lo=0, hi=127)
            t.put("fp16.initial_scale", float(2 ** p_), "fp16.initial_scale_power")
        t.copy(fp16, "fp16.", _FP16_KEYS)
        t.ignored += [f"fp16.{k}" for k in ("hysteresis", "consecutive_hysteresis") if k in fp16]
    else:
        t.ignored += [f"fp16.{k}" for k in fp16 if k != "enabled"]  # DeepSpeed ignores them too
        if bf16_on:
            t.put("precision", "bf16", "bf16.enabled")
            if _ds_bool(bf16, "check_grad_overflow", False, "bf16"):
                # DeepSpeed skips the step on inf/NaN gradients: infinity's "skip" policy
                t.put("nonfinite_grads", "skip", "bf16.check_grad_overflow")
    t.ignored += [f"bf16.{k}" for k in bf16 if k not in ("enabled", "check_grad_overflow")]


def _optimizer(ds: Mapping, t: _Translation) -> None:
    """``optimizer``: Adam or AdamW and its hyperparameters."""
    opt = _ds_section(ds, "optimizer")
    _ds_unknown(opt, ("type", "params", "adam_w_mode", "torch_adam"), "optimizer")
    if not opt:
        return
    typ = opt.get("type", "AdamW")
    if not isinstance(typ, str) or typ.lower() not in ("adam", "adamw"):
        raise _ds_err("optimizer.type", f"only Adam and AdamW are supported, got "
                      f"{fmt_value(typ)}; use \"AdamW\"")
    params = _ds_section(opt, "params", "optimizer.")
    _ds_unknown(params, ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam",
                         "bias_correction", "amsgrad", "fused", "foreach"), "optimizer.params")
    adam_w_mode = params.get("adam_w_mode", opt.get("adam_w_mode", True))
    if not isinstance(adam_w_mode, bool):
        raise _ds_err("optimizer.params.adam_w_mode",
                      f"expected true or false, got {fmt_value(adam_w_mode)}")
    is_w = typ.lower() == "adamw" or adam_w_mode
    t.put("optimizer.type", "adamw" if is_w else "adam", "optimizer.type")
    if not _ds_bool(params, "bias_correction", True, "optimizer.params"):
        raise _ds_err("optimizer.params.bias_correction", "only bias-corrected Adam is "
                      "supported; remove the key")
    if _ds_bool(params, "amsgrad", False, "optimizer.params"):
        raise _ds_err("optimizer.params.amsgrad", "AMSGrad is not supported; remove it")
    t.copy(params, "optimizer.params.", _ADAM_KEYS)
    t.ignored += [f"optimizer.params.{k}" for k in ("torch_adam", "fused", "foreach")
                  if k in params] + (["optimizer.torch_adam"] if "torch_adam" in opt else [])


def _scheduler(ds: Mapping, t: _Translation) -> None:
    _ds_scheduler(_ds_section(ds, "scheduler"), t.out, t.put, t.approximate)


def _curriculum(ds: Mapping, t: _Translation) -> None:
    """The legacy sequence-length curriculum: same keys, same meanings (infinity.curriculum)."""
    for k, v in _ds_section(ds, "curriculum_learning").items():
        if k == "schedule_config" and isinstance(v, Mapping) and v:
            for sk, sv in v.items():
                t.put(f"curriculum_learning.schedule_config.{sk}", sv,
                      f"curriculum_learning.schedule_config.{sk}")
        else:
            t.put(f"curriculum_learning.{k}", v, f"curriculum_learning.{k}")


def _loop(ds: Mapping, t: _Translation) -> None:
    """The training loop's keys."""
    t.copy(ds, "", _LOOP_KEYS)
    if ("gradient_accumulation_steps" not in ds and "train_batch_size" in ds
            and "train_micro_batch_size_per_gpu" in ds
            and ds["train_batch_size"] != ds["train_micro_batch_size_per_gpu"]):
        log.warning("DeepSpeed derives gradient_accumulation_steps from train_batch_size / "
                    "(train_micro_batch_size_per_gpu * world size); infinity does not know the "
                    "world size here, so it uses 1: set gradient_accumulation_steps explicitly")


#: the translation, section by section (each ``(ds, translation)``), in this order
_SECTIONS = (_features, _zero, _aio, _precision, _optimizer, _scheduler, _curriculum, _loop)


def deepspeed_to_dict(ds: Any, *, approximate_schedules: bool = False,
                      ignored_out: list | None = None) -> tuple[dict, dict[str, str]]:
    """Translate a DeepSpeed config dict; returns (infinity dict, {infinity key: DS key}).
    ``ignored_out`` (a list), when given, receives the DeepSpeed keys accepted but ignored
    (logged at INFO here; ``InfinityTrainer`` shows them in its start-of-training summary)."""
    if not isinstance(ds, Mapping):
        raise ConfigError(f"DeepSpeed config: expected a mapping at the top level, got "
                          f"{type(ds).__name__}")
    _ds_find_auto(ds)
    _ds_unknown(ds, _KNOWN_TOP, "")
    t = _Translation(approximate_schedules)
    t.ignored += [k for k in ds if k in DS_IGNORED_TOP_KEYS]
    for section in _SECTIONS:
        section(ds, t)
    if ignored_out is not None:
        ignored_out.extend(t.ignored)
    if t.ignored:
        log.info("DeepSpeed keys accepted but ignored (tuning-only, or data loading which is "
                 "the caller's job): %s", ", ".join(t.ignored))
    return t.out, t.origin


def _ds_scheduler(sch: Mapping, out: dict, put, approximate: bool) -> None:
    if not sch:
        return
    _ds_unknown(sch, ("type", "params"), "scheduler")
    typ = sch.get("type")
    params = _ds_section(sch, "params", "scheduler.")
    kinds = {"WarmupLR": "constant", "WarmupDecayLR": "linear", "WarmupCosineLR": "cosine"}
    if typ not in kinds:
        raise _ds_err("scheduler.type", f"{fmt_value(typ)} has no infinity equivalent; supported: "
                      f"WarmupLR, WarmupDecayLR, WarmupCosineLR (or use infinity's own "
                      f"scheduler.type constant/linear/cosine)")
    kind = kinds[typ]
    cosine = kind == "cosine"
    allowed = (("total_num_steps", "warmup_min_ratio", "warmup_num_steps", "cos_min_ratio",
                "warmup_type", "last_batch_iteration") if cosine else
               ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type",
                "last_batch_iteration") + (("total_num_steps",) if kind == "linear" else ()))
    _ds_unknown(params, allowed, "scheduler.params")
    if params.get("last_batch_iteration", -1) != -1:
        raise _ds_err("scheduler.params.last_batch_iteration", "resuming a schedule is done "
                      "through infinity checkpoints; remove the key")
    wtype = params.get("warmup_type", "log")
    if wtype not in ("log", "linear"):
        raise _ds_err("scheduler.params.warmup_type", f'expected "log" or "linear", got {fmt_value(wtype)}')
    warm = parse_int("DeepSpeed scheduler.params.warmup_num_steps",
                     params.get("warmup_num_steps", 1000), lo=0)
    # DeepSpeed clamps warmup_num_steps to >= 2 and warms up as min + delta * step / warm
    warm = max(2, warm)
    if wtype == "log":
        msg = ('DeepSpeed\'s default "log" warmup has no infinity equivalent (infinity warms up '
               'linearly); set "warmup_type": "linear"')
        if not approximate:
            raise _ds_err("scheduler.params.warmup_type", msg + " or pass approximate_schedules=True")
        log.warning("%s; translated as linear warmup (approximate_schedules=True)", msg)
    put("scheduler.type", kind, "scheduler.type")
    put("scheduler.warmup_steps", warm, "scheduler.params.warmup_num_steps")
    if cosine:
        wmr = params.get("warmup_min_ratio", 0.0)
        if wmr not in (0, 0.0):
            raise _ds_err("scheduler.params.warmup_min_ratio", f"infinity warms up from lr 0; "
                          f"got {fmt_value(wmr)}; set it to 0")
        if "total_num_steps" not in params:
            raise _ds_err("scheduler.params.total_num_steps", "required for WarmupCosineLR")
        put("scheduler.total_steps", params["total_num_steps"], "scheduler.params.total_num_steps")
        cmr = parse_float("DeepSpeed scheduler.params.cos_min_ratio",
                          params.get("cos_min_ratio", 0.0001), lo=0.0, hi=1.0)
        lr = out.get("optimizer", {}).get("lr", OptimizerConfig.lr)
        lr = parse_float("DeepSpeed optimizer.params.lr", lr, lo=0.0)
        put("scheduler.min_lr", lr * cmr, "scheduler.params.cos_min_ratio")
        msg = ("DeepSpeed's WarmupCosineLR cosine phase runs one step ahead of infinity's "
               "(it reaches min_lr at total_num_steps - 1)")
        if not approximate:
            raise _ds_err("scheduler.type", msg + "; pass approximate_schedules=True to accept "
                          "that, or set infinity's scheduler {\"type\": \"cosine\", ...} yourself")
        log.warning("%s; translated as cosine (approximate_schedules=True)", msg)
        return
    wmin = params.get("warmup_min_lr", 0.0)
    if wmin not in (0, 0.0):
        raise _ds_err("scheduler.params.warmup_min_lr", f"infinity warms up from lr 0; got "
                      f"{fmt_value(wmin)}; set it to 0")
    wmax = params.get("warmup_max_lr", 0.001)
    opt_lr = out.get("optimizer", {}).get("lr")
    if opt_lr is not None and opt_lr != wmax:
        log.info("DeepSpeed scheduler.params.warmup_max_lr (%s) overrides optimizer.params.lr "
                 "(%s), as in DeepSpeed", wmax, opt_lr)
    put("optimizer.lr", wmax, "scheduler.params.warmup_max_lr")
    if kind == "linear":
        if "total_num_steps" not in params:
            raise _ds_err("scheduler.params.total_num_steps", "required for WarmupDecayLR")
        put("scheduler.total_steps", params["total_num_steps"], "scheduler.params.total_num_steps")
