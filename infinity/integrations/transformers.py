"""The Hugging Face ``Trainer`` driving an infinity engine.

    from infinity.integrations.transformers import InfinityTrainer
    trainer = InfinityTrainer(model=model, args=args, train_dataset=ds,
                              infinity_config="ds_config.json")   # or a dict / InfinityConfig
    trainer.train()

``InfinityTrainerMixin`` goes in front of any ``Trainer`` subclass
(``class MyTrainer(InfinityTrainerMixin, SomeTrainer)``); ``InfinityTrainer`` is the mixin over
``transformers.Trainer``.  What changes against the plain Trainer (docs/trainers.md):

* the model is given to :func:`infinity.initialize` when training starts (or at the first
  evaluation of a model built under :class:`infinity.Init`); Accelerate never wraps it (no
  DDP: the engine reduces gradients across ranks itself);
* the optimizer is the engine's CPU AdamW and the Trainer's ``optimizer``/``lr_scheduler``
  are views of it: the schedule (``lr_scheduler_type``, warmup, or a DeepSpeed config's
  scheduler) is stepped by the engine at each applied update;
* ``training_step`` runs ``engine.backward`` and ``engine.step`` with the loss the plain
  Trainer would differentiate (one division for accumulation, no double scaling);
* checkpoints ``checkpoint-N/`` hold infinity's sharded checkpoint (tag ``infinity``: fp32
  masters, Adam moments, counters, schedule, RNG, wherever they lived) with Trainer's
  ``trainer_state.json`` and the model's ``config.json`` — nothing pickled;
* ``save_model`` writes ``from_pretrained``-loadable safetensors (adapters only, as PEFT
  does, for a PEFT model), the config and the tokenizer, and ``training_args.json``;
* a ``curriculum_learning`` block in the config adds a
  :class:`~infinity.integrations.curriculum.CurriculumCallback`: training batches are
  truncated to the step's sequence length, logged as ``curriculum_seqlen``.
"""
from __future__ import annotations

import json
import logging
import os
import sys

import torch

from infinity.config import ConfigError

log = logging.getLogger("infinity.integrations")

__all__ = ["InfinityTrainerMixin", "InfinityTrainer", "from_pretrained"]

CHECKPOINT_TAG = "infinity"


class _ScheduleBox:
    """What the engine sees as its torch LR scheduler (``initialize(lr_scheduler=...)``):
    the Trainer's scheduler, created later (when the step count is known) on the engine's
    schedule target; stepped by the engine at each applied update."""

    def __init__(self):
        self.target = None        # the engine's torch Optimizer carrying per-group lr
        self.inner = None

    def attach(self, target):
        self.target = target
        return self

    def step(self):
        if self.inner is not None:
            self.inner.step()

    def get_last_lr(self):
        if self.inner is not None:
            return self.inner.get_last_lr()
        return [pg["lr"] for pg in self.target.param_groups]

    def state_dict(self):
        return self.inner.state_dict() if self.inner is not None else None

    def load_state_dict(self, state):
        if self.inner is None:
            raise RuntimeError("InfinityTrainer: the schedule is restored before it exists "
                               "(internal error)")
        self.inner.load_state_dict(state)


class _OptimizerView:
    """``trainer.optimizer``: the engine's parameter groups (lr, betas, eps, weight decay);
    ``step``/``zero_grad`` do nothing (``training_step`` drives the engine)."""

    def __init__(self, box):
        self._box = box

    @property
    def param_groups(self):
        return self._box.target.param_groups

    @property
    def state(self):
        return {}

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True):
        return None

    def state_dict(self):
        return {"state": {}, "param_groups": []}

    def load_state_dict(self, state):
        return None


class _SchedulerView:
    """``trainer.lr_scheduler``: reports the lr of the last applied update (what the
    plain Trainer logs); ``step`` does nothing (the engine steps the schedule)."""

    def __init__(self, trainer):
        self._t = trainer

    def step(self, *a, **k):
        return None

    def get_last_lr(self):
        if self._t._last_lrs is not None:
            return list(self._t._last_lrs)
        return self._t._box.get_last_lr()

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


def _has_init_params(model) -> bool:
    from infinity.zero.init import is_managed
    return any(is_managed(p) for p in model.parameters())


def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class InfinityTrainerMixin:
    """Put in front of a ``transformers.Trainer`` (sub)class; adds the keyword
    ``infinity_config`` (dict, JSON/YAML path, :class:`~infinity.config.InfinityConfig`, or a
    DeepSpeed config with ``"auto"`` values).  See the module doc and docs/trainers.md."""

    def __init__(self, *args, infinity_config=None, **kwargs):
        opts = kwargs.get("optimizers")
        if opts is not None and any(o is not None for o in opts):
            raise ConfigError("InfinityTrainer: optimizers=(optimizer, scheduler) cannot be used: "
                              "the optimizer is infinity's CPU AdamW at the states' offload home; "
                              "set the recipe through TrainingArguments (learning_rate, "
                              "lr_scheduler_type, warmup_steps, weight_decay, ...)")
        if kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ConfigError("InfinityTrainer: optimizer_cls_and_kwargs cannot be used: the "
                              "optimizer is infinity's CPU AdamW")
        self._infinity_source = infinity_config
        self.engine = None
        self._box = _ScheduleBox()
        self._ds_sched = None
        self._last_lrs = None
        self._resume_meta = None
        self._in_checkpoint = False
        super().__init__(*args, **kwargs)
        args_ = self.args
        if getattr(args_, "deepspeed", None):
            raise ConfigError("InfinityTrainer: TrainingArguments(deepspeed=...) is set; give the "
                              "DeepSpeed config as infinity_config=... instead (it is translated)")
        from infinity.integrations.trainer_config import check_optim
        check_optim(args_)
        self._patch_accelerator()
        self._add_curriculum_callback()

    # ------------------------------------------------------------------ curriculum
    def _add_curriculum_callback(self) -> None:
        """A ``CurriculumCallback`` when the config has an enabled ``curriculum_learning``
        block (and none was passed in ``callbacks``)."""
        from infinity.curriculum import schedule_from_config
        sched = schedule_from_config(_curriculum_block(self._infinity_source))
        if sched is not None and self._curriculum() is None:
            from infinity.integrations.curriculum import CurriculumCallback
            self.add_callback(CurriculumCallback(sched))

    def _curriculum(self):
        """The trainer's ``CurriculumCallback`` (looked up each time: resuming with
        ``restore_callback_states_from_checkpoint`` replaces it), or None."""
        from infinity.integrations.curriculum import CurriculumCallback
        for cb in self.callback_handler.callbacks:
            if isinstance(cb, CurriculumCallback):
                return cb
        return None

    def log(self, logs, *args, **kwargs):
        cur = self._curriculum()
        if cur is not None and cur.last_length is not None and "loss" in logs:
            from infinity.integrations.curriculum import LOG_KEY
            logs[LOG_KEY] = cur.last_length
        return super().log(logs, *args, **kwargs)

    # ------------------------------------------------------------------ accelerate
    def _patch_accelerator(self) -> None:
        """Accelerate must neither wrap the model (DDP, autocast) nor the optimizer view, and
        its gradient clipping reports the engine's gradient norm (the engine clips)."""
        acc = self.accelerator
        orig_prepare, orig_prepare_model = acc.prepare, acc.prepare_model
        trainer = self

        def ours(o):
            return o is not None and (o is trainer.model or isinstance(o, _OptimizerView))

        def prepare(*objs, device_placement=None):
            if not any(ours(o) for o in objs):
                return orig_prepare(*objs, device_placement=device_placement)
            rest = [o for o in objs if not ours(o)]
            done = orig_prepare(*rest, device_placement=device_placement) if rest else ()
            if len(rest) == 1:
                done = (done,)
            done = iter(done)
            out = tuple(o if ours(o) else next(done) for o in objs)
            return out[0] if len(out) == 1 else out

        def prepare_model(model, device_placement=None, evaluation_mode=False):
            if model is trainer.model:
                return model
            return orig_prepare_model(model, device_placement=device_placement,
                                      evaluation_mode=evaluation_mode)

        orig_clip = acc.clip_grad_norm_

        def clip_grad_norm_(parameters, max_norm, norm_type=2):
            if trainer.engine is None:
                return orig_clip(parameters, max_norm, norm_type=norm_type)
            return torch.tensor(float(trainer.engine.stats()["grad_norm"]))

        acc.prepare, acc.prepare_model = prepare, prepare_model
        acc.clip_grad_norm_ = clip_grad_norm_

    def _move_model_to_device(self, model, device):
        if _has_init_params(model):      # built under infinity.Init: the engine places it
            return
        return super()._move_model_to_device(model, device)

    # ------------------------------------------------------------------ the engine
    def _ensure_engine(self):
        if self.engine is not None:
            return self.engine
        import infinity
        from infinity.integrations.trainer_config import resolve_trainer_config
        ignored: list[str] = []
        cfg, self._ds_sched = resolve_trainer_config(self._infinity_source, self.args,
                                                     model=self.model, ignored=ignored)
        log.info("InfinityTrainer: engine config %s", json.dumps(cfg.to_dict()))
        self.engine = infinity.initialize(self.model, cfg, lr_scheduler=self._box.attach)
        self._announce_placement(ignored)
        return self.engine

    def _announce_placement(self, ignored) -> None:
        """The start-of-training summary (main process only): where params, optimizer
        states and gradients live, the bytes per tier, the swap path, and the DeepSpeed keys
        accepted but ignored.  Shown at the Trainer's default log level (``passive``: the
        main process logs at WARNING), silenced by ``log_level="error"``/``"critical"``."""
        if not self.is_world_process_zero():
            return
        if self.args.get_process_log_level() > logging.WARNING:
            return
        text = placement_summary(self.engine, ignored)
        if text:   # printed: the "infinity" loggers have only a NullHandler unless configured
            print(text, file=sys.stderr, flush=True)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            self._ensure_engine()
            self.optimizer = _OptimizerView(self._box)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        if self.lr_scheduler is None:
            self._ensure_engine()
            target = self._box.target
            if self._ds_sched:
                from torch.optim.lr_scheduler import LambdaLR

                from infinity.config_deepspeed import fill_auto
                from infinity.integrations.trainer_config import ds_schedule_lambda
                filled, _ = fill_auto({"scheduler": self._ds_sched}, self.args,
                                      num_training_steps=num_training_steps)
                inner = LambdaLR(target, ds_schedule_lambda(filled["scheduler"],
                                                            float(self.args.learning_rate)))
            else:
                from transformers import get_scheduler
                warm = self.args.get_warmup_steps(num_training_steps)
                inner = get_scheduler(self.args.lr_scheduler_type, optimizer=target,
                                      num_warmup_steps=warm,
                                      num_training_steps=num_training_steps,
                                      scheduler_specific_kwargs=self.args.lr_scheduler_kwargs)
            if isinstance(inner, torch.optim.lr_scheduler.ReduceLROnPlateau):
                raise ConfigError("InfinityTrainer: lr_scheduler_type reduce_lr_on_plateau is not "
                                  "supported (the engine steps the schedule at each update)")
            self._box.inner = inner
            self._last_lrs = None
            self.lr_scheduler = _SchedulerView(self)
            self._created_lr_scheduler = True
        return self.lr_scheduler

    # ------------------------------------------------------------------ one micro-batch
    def training_step(self, model, inputs, num_items_in_batch=None):
        eng = self._ensure_engine()
        gas = eng.cfg.gradient_accumulation_steps
        micro = int(eng.stats()["micro_step"])
        boundary = (micro + 1) % gas == 0
        sync = getattr(self.accelerator, "sync_gradients", boundary)
        if sync != boundary:
            raise RuntimeError(
                f"InfinityTrainer: the Trainer's optimizer step ({'now' if sync else 'later'}) and "
                f"the engine's accumulation boundary (every {gas} micro-batches; this is "
                f"micro-batch {micro % gas + 1}) disagree: an epoch's batch count must be a multiple "
                f"of gradient_accumulation_steps (set dataloader_drop_last=True and a dataset "
                f"size that divides, or max_steps)")
        # the plain Trainer differentiates ``loss`` as returned by its own training_step
        # (already scaled for accumulation, by num_items_in_batch or 1/accumulation);
        # engine.backward divides by gas once more, so it is given gas * that loss
        cur = self._curriculum()
        if cur is not None:     # the length of this update: state.global_step updates done
            inputs = cur.truncate(inputs, self.state.global_step)
            if self.engine is not None:
                self.engine.set_curriculum_length(cur.last_length)
        captured = {}
        real_acc = self.accelerator
        self.accelerator = _AccProxy(real_acc, captured)
        try:
            loss = super().training_step(model, inputs, num_items_in_batch)
        finally:
            self.accelerator = real_acc
        if "loss" not in captured:
            raise RuntimeError("InfinityTrainer: training_step of the Trainer class did not call "
                               "accelerator.backward(loss); cannot drive the engine")
        eng.backward(captured["loss"] * gas if gas != 1 else captured["loss"])
        if boundary:
            self._last_lrs = [pg["lr"] for pg in self._box.target.param_groups]
        applied = eng.step()
        if boundary and not applied and not self.args.fp16:   # fp16: an overflow skips it
            raise RuntimeError("InfinityTrainer: the engine did not apply the update at the "
                               "Trainer's optimizer step (internal error)")
        return loss

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, *args, **kwargs):
        if self.engine is None and _has_init_params(self.model):
            self._ensure_engine()
        return super().evaluate(*args, **kwargs)

    def predict(self, *args, **kwargs):
        if self.engine is None and _has_init_params(self.model):
            self._ensure_engine()
        return super().predict(*args, **kwargs)

    # ------------------------------------------------------------------ saving
    def _save_checkpoint(self, model, trial):
        self._in_checkpoint = True
        try:
            return super()._save_checkpoint(model, trial)
        finally:
            self._in_checkpoint = False

    def _save_optimizer_and_scheduler(self, output_dir):
        self._ensure_engine().save_checkpoint(output_dir, tag=CHECKPOINT_TAG)

    def _save_scaler(self, output_dir):
        return None          # the fp16 loss scale is in infinity's checkpoint

    def _save_rng_state(self, output_dir):
        return None          # every rank's RNG state is in infinity's checkpoint meta

    def save_model(self, output_dir=None, _internal_call: bool = False):
        """``from_pretrained``-loadable safetensors + config (PEFT: the adapters, as PEFT
        saves them), the tokenizer and ``training_args.json``.  Inside a checkpoint the
        weights are not written again (infinity's checkpoint holds the fp32 masters;
        ``infinity export`` or ``save_model`` after ``load_checkpoint`` gives safetensors)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self.engine is None and not _has_init_params(self.model):
            return super().save_model(output_dir, _internal_call=_internal_call)
        eng = self._ensure_engine()
        should = self.args.should_save
        if should:
            os.makedirs(output_dir, exist_ok=True)
        model = self.model
        if self._in_checkpoint and not self.args.save_only_model:
            # infinity's checkpoint (written next) holds the weights: only the config here
            cfg = getattr(model, "config", None)
            if should and cfg is not None and hasattr(cfg, "save_pretrained"):
                cfg.save_pretrained(output_dir)
        elif _is_peft(model):
            sd = eng.state_dict()
            trainable = [n for n, p in model.named_parameters() if p.requires_grad]
            adapters = {n: sd[n] for n in trainable}     # collective at world size > 1
            model.save_pretrained(output_dir, state_dict=adapters, is_main_process=should)
        else:
            eng.save_pretrained(output_dir)
        if not should:
            return
        pc = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
        if pc is not None and hasattr(pc, "save_pretrained"):
            pc.save_pretrained(output_dir)
        with open(os.path.join(output_dir, "training_args.json"), "w", encoding="utf-8") as f:
            f.write(self.args.to_json_string())
        from infinity.checkpoint.export import public_file_modes
        public_file_modes(output_dir)     # one mode for every file, as save_pretrained's

    # ------------------------------------------------------------------ resuming
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_TAG)):
            raise ConfigError(f"InfinityTrainer: {resume_from_checkpoint} holds no infinity "
                              f"checkpoint ({CHECKPOINT_TAG}/): a plain Trainer's, or one saved "
                              f"with save_only_model=True, has no optimizer state to resume "
                              f"(to start from its weights, load them into the model and train "
                              f"without resume_from_checkpoint)")

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        self._load_from_checkpoint(checkpoint)
        self._resume_meta = self._ensure_engine().load_checkpoint(checkpoint, tag=CHECKPOINT_TAG)
        self._last_lrs = None

    def _load_scaler(self, checkpoint):
        return None

    def _load_rng_state(self, checkpoint):
        """The Trainer restores the RNG where the interrupted run was (after skipping the
        consumed batches): the states saved in infinity's checkpoint meta."""
        meta = self._resume_meta
        if checkpoint is None or not meta:
            return
        from infinity.checkpoint.rng import rng_state_from_json
        rng, ranks = meta.get("rng"), meta.get("rng_ranks")
        rank = self.args.process_index
        if ranks and rank < len(ranks):
            rng = ranks[rank]
        if rng is not None:
            rng_state_from_json(rng)

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        log.info("InfinityTrainer: loading the best checkpoint %s", best)
        self._ensure_engine().load_checkpoint(best, tag=CHECKPOINT_TAG)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Close the engine (idempotent): hooks removed, swap space freed."""
        if self.engine is not None:
            self.engine.close()


def placement_summary(engine, ignored=()) -> str:
    """A few lines saying what lives where (from ``engine.placement``), the swap path, and
    the DeepSpeed keys accepted but ignored."""
    plan = getattr(engine, "placement", None)
    lines = []
    if plan is not None:
        lines.append(f"infinity placement: {plan.summary()}")
    swap = getattr(engine, "swap", None)
    paths = list(swap.paths) if swap is not None else []
    lines.append("infinity swap: " + (", ".join(paths) if paths else "none (nothing on NVMe)"))
    if ignored:
        lines.append("infinity: DeepSpeed keys accepted but ignored (tuning-only, or data "
                     "loading which is the Trainer's job): " + ", ".join(ignored))
    return "\n".join(lines)


class _AccProxy:
    """The Trainer's accelerator during one ``training_step``: ``backward`` records the
    loss instead of differentiating it; everything else is the real accelerator."""

    def __init__(self, real, captured):
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_captured", captured)

    def backward(self, loss, **kwargs):
        self._captured["loss"] = loss

    def __getattr__(self, name):
        return getattr(self._real, name)

    def __setattr__(self, name, value):
        setattr(self._real, name, value)


from transformers import Trainer as _Trainer  # noqa: E402  (a runtime dependency)


class InfinityTrainer(InfinityTrainerMixin, _Trainer):
    """``transformers.Trainer`` on an infinity engine: ``InfinityTrainer(...,
    infinity_config=cfg)``."""


# ---------------------------------------------------------------------- big models
def from_pretrained(model_dir, infinity_config=None, *, auto_class=None, **config_kwargs):
    """Build the model of a local Hugging Face directory (``config.json`` +
    ``*.safetensors``) under :class:`infinity.Init` and stream its weights tensor by tensor
    into their offloaded homes: the model never exists whole in host memory.  Give the
    result to ``InfinityTrainer`` (or ``infinity.initialize``) with the same
    ``infinity_config``.  ``auto_class``: default ``AutoModelForCausalLM``.  No network."""
    import transformers

    from infinity.zero.init import Init, load_safetensors
    model_dir = os.fspath(model_dir)
    if not os.path.isdir(model_dir):
        raise FileNotFoundError(f"from_pretrained: {model_dir} is not a local directory "
                                f"(download it first, e.g. huggingface-cli download)")
    files = _safetensors_files(model_dir)
    auto_class = auto_class or transformers.AutoModelForCausalLM
    config = transformers.AutoConfig.from_pretrained(model_dir, local_files_only=True,
                                                     **config_kwargs)
    cfg = _init_config(infinity_config)
    with Init(cfg, skip_init=True):      # (every parameter is loaded below, strictly)
        model = auto_class.from_config(config)
    names = dict(model.named_parameters(remove_duplicate=False))
    from infinity.zero.init import prefix_resolver
    resolve = prefix_resolver(names, getattr(model, "base_model_prefix", "") or "")
    unexpected = load_safetensors(model, files, strict=True, resolve=resolve)
    if unexpected:
        log.info("from_pretrained: %d checkpoint tensors match no parameter, e.g. %s",
                 len(unexpected), unexpected[:5])
    return model


def _init_config(infinity_config):
    """The config ``Init`` needs (offload homes, NVMe paths, aio) from any form
    ``InfinityTrainer`` accepts; the training recipe does not matter here."""
    from infinity.config import InfinityConfig
    src = infinity_config
    if isinstance(src, (str, os.PathLike)):
        from infinity.integrations.trainer_config import read_config_file
        src = read_config_file(os.fspath(src))
    if isinstance(src, dict) and "zero_optimization" in src:
        from infinity.config_deepspeed import deepspeed_to_dict
        ds = {k: src[k] for k in ("zero_optimization", "aio") if k in src}
        d, _ = deepspeed_to_dict(_strip_auto(ds))
        return InfinityConfig.from_dict(d)
    return InfinityConfig.load(src)


def _curriculum_block(source):
    """The ``curriculum_learning`` block of any ``infinity_config`` form (the DeepSpeed and
    the infinity block have the same keys), or None."""
    from infinity.config import InfinityConfig
    if isinstance(source, InfinityConfig):
        return source.curriculum_learning
    if isinstance(source, (str, os.PathLike)):
        from infinity.integrations.trainer_config import read_config_file
        source = read_config_file(os.fspath(source))
    if isinstance(source, dict):
        return source.get("curriculum_learning")
    return None


def _strip_auto(obj):
    if isinstance(obj, dict):
        return {k: _strip_auto(v) for k, v in obj.items()
                if not (isinstance(v, str) and v.strip().lower() == "auto")}
    return obj


def _safetensors_files(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            wm = json.load(f)["weight_map"]
        return [os.path.join(model_dir, fn) for fn in sorted(set(wm.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(fn for fn in os.listdir(model_dir) if fn.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"from_pretrained: no *.safetensors weights in {model_dir} "
                                f"(pickled .bin weights are never loaded)")
    return [os.path.join(model_dir, fn) for fn in found]
