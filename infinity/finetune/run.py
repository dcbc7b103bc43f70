"""`infinity finetune` end to end: config, data, model, engine, loop, summary.

:func:`finetune` is what the CLI calls (``infinity/cli/finetune.py`` only parses
arguments). User mistakes raise :class:`FinetuneError` with what to do.
"""
import contextlib
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from infinity.memory.plan import remove_if_empty
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.finetune")


class FinetuneError(RuntimeError):
    """A user-facing failure of `infinity finetune` (bad flag, data, model, ...)."""


@dataclass
class FinetuneOptions:
    model: str = None
    data: str = None
    config: str = None
    nvme_paths: list = field(default_factory=list)
    steps: int = 30
    batch_tokens: int = 4096
    seq_len: int = 256
    lr: float = None
    state_dtype: str = None         # optimizer.state_dtype override ("fp32" | "bf16")
    save: str = None
    output: str = None              # write the fine-tuned model (HF directory) here at the end
    save_every: int = 0
    keep_last: int = 0
    resume: bool = False            # resuming is the default; kept so old command lines work
    restart: bool = False           # move --save's checkpoints into previous-<UTC>/, start at 1
    command: str = None             # the command line, for "resume with" after a stop (CLI)
    profile: str = None
    profile_skip: int = 1           # warm-up steps left out of the profile (the first records the order)
    json_lines: bool = False
    seed: int = 0
    tokenizer: str = "auto"         # "auto": the model directory's own tokenizer if it has one

    use_bench_io: bool = True
    auto: bool = False              # plan homes, activations, micro-batch x accumulation (finetune/auto.py)
    allow_lossy: bool = False       # --auto may choose bf16 Adam moments / bf16 gradient partial sums
    curriculum: str = None          # "seqlen:START:STEPS[:linear|root|discrete]" (infinity.curriculum)
    drive_tbw: float = None         # the drives' rated TB written (the summary gives their life)
    lora: int = None                # LoRA rank (None: full fine-tuning), infinity.finetune.lora
    lora_targets: list = None       # module-name suffixes (None: every Linear but the LM head)
    lora_alpha: float = None        # None: 2 x rank
    lora_dropout: float = None      # None: 0.0
    frozen_dtype: str = None        # offload.frozen_weights.dtype override ("nf4"|"int8"|"int4")


def dist_env():
    """(rank, world_size, local_rank) from torchrun's environment."""
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return rank, world, local


def _validate(opts):
    for name in ("steps", "batch_tokens", "seq_len"):
        v = getattr(opts, name)
        if not isinstance(v, int) or v < 1:
            raise FinetuneError(f"--{name.replace('_', '-')} must be a positive integer, got {v!r}")
    if opts.seq_len < 2:
        raise FinetuneError("--seq-len must be at least 2")
    for name in ("save_every", "keep_last", "profile_skip"):
        v = getattr(opts, name)
        if v < 0:
            raise FinetuneError(f"--{name.replace('_', '-')} must be >= 0, got {v}")
    if opts.drive_tbw is not None and not (isinstance(opts.drive_tbw, (int, float))
                                           and opts.drive_tbw > 0):
        raise FinetuneError(f"--drive-tbw must be a positive number of TB, got {opts.drive_tbw!r}")
    if (opts.save_every or opts.keep_last) and not opts.save:
        raise FinetuneError("--save-every/--keep-last need --save DIR")
    if opts.resume and not opts.save:
        raise FinetuneError("--resume needs --save DIR (the checkpoint directory to continue from)")
    if opts.restart and not opts.save:
        raise FinetuneError("--restart needs --save DIR (the checkpoint directory to start over in)")
    if opts.restart and opts.resume:
        raise FinetuneError("--restart and --resume contradict each other: --restart moves the "
                            "checkpoints aside and starts at step 1, --resume continues from them")
    if opts.tokenizer not in ("auto", "byte"):
        raise FinetuneError(f"--tokenizer must be 'auto' or 'byte', got {opts.tokenizer!r}")
    if opts.curriculum is not None:
        from infinity.curriculum import parse_cli_spec

        try:
            parse_cli_spec(opts.curriculum)
        except ValueError as e:
            raise FinetuneError(str(e)) from e
    if opts.lr is not None and not (opts.lr > 0):
        raise FinetuneError(f"--lr must be > 0, got {opts.lr}")
    _validate_lora(opts)
    if opts.output:
        from infinity.finetune.output import OutputError, check_output_dir

        try:
            check_output_dir(opts.output)
        except OutputError as e:
            raise FinetuneError(str(e)) from e


def _validate_lora(opts):
    """The LoRA flags on their own (against the model: :func:`_lora_spec`)."""
    from infinity.finetune.lora import FROZEN_DTYPES, LoraError, check_values, import_peft

    if opts.frozen_dtype is not None and opts.frozen_dtype not in FROZEN_DTYPES:
        raise FinetuneError(f"--frozen-dtype must be one of {', '.join(FROZEN_DTYPES)}, got "
                            f"{opts.frozen_dtype!r}")
    if opts.lora is None:
        given = [f for f, v in (("--lora-targets", opts.lora_targets),
                                ("--lora-alpha", opts.lora_alpha),
                                ("--lora-dropout", opts.lora_dropout)) if v is not None]
        if given:
            raise FinetuneError(f"{'/'.join(given)} set(s) the LoRA adapters: add --lora R "
                                "(the adapters' rank, e.g. --lora 8)")
        if opts.frozen_dtype is not None:
            raise FinetuneError(f"--frozen-dtype {opts.frozen_dtype} stores the frozen base of a "
                                "LoRA run quantized; full fine-tuning trains every weight, so "
                                "nothing is frozen: add --lora R (e.g. --lora 8) to train LoRA "
                                "adapters over the quantized base")
        return
    try:
        check_values(opts.lora, opts.lora_alpha, opts.lora_dropout)
        if opts.lora_targets is not None and not opts.lora_targets:
            raise LoraError("--lora-targets needs at least one module name")
        import_peft()
    except LoraError as e:
        raise FinetuneError(str(e)) from e
    if opts.output and opts.model and os.path.isdir(opts.model) and \
            os.path.abspath(opts.output) == os.path.abspath(opts.model):
        raise FinetuneError(f"--output {opts.output} is the --model directory: the LoRA "
                            "adapters name it as their base, so it must stay; choose another "
                            "--output")


def _frozen_dtype(cfg):
    return ((cfg.get("offload") or {}).get("frozen_weights") or {}).get("dtype")


def _check_frozen(opts, cfg):
    """``offload.frozen_weights.dtype`` (``--frozen-dtype`` or ``--config``) against the
    run: only a LoRA run has a frozen base. What the engine does not support it refuses at
    ``initialize``, naming the key."""
    dtype = _frozen_dtype(cfg)
    if dtype is None:
        return None
    where = "--frozen-dtype" if opts.frozen_dtype is not None else \
        f"offload.frozen_weights.dtype in --config {opts.config}"
    if opts.lora is None:
        raise FinetuneError(f"{where} is {dtype!r}: it stores the frozen base of a LoRA run "
                            "quantized, and full fine-tuning trains every weight (nothing is "
                            "frozen): add --lora R (e.g. --lora 8), or remove "
                            "offload.frozen_weights from the config")
    return dtype


def _lora_spec(opts):
    """The run's :class:`infinity.finetune.lora.LoraSpec`: the flags checked against the
    model built on the ``meta`` device (nothing allocated), before anything is built."""
    from infinity.finetune.auto import model_config_path
    from infinity.finetune.lora import LoraError, make_spec
    from infinity.finetune.model import build_model, load_model_config, parameters_on_meta

    config = load_model_config(model_config_path(opts.model))
    with parameters_on_meta():
        meta = build_model(config)
    try:
        return make_spec(meta, rank=opts.lora, alpha=opts.lora_alpha,
                         dropout=opts.lora_dropout or 0.0, targets=opts.lora_targets)
    except LoraError as e:
        raise FinetuneError(str(e)) from e


def _shape(opts, model):
    max_pos = getattr(model.config, "max_position_embeddings", None) or \
        getattr(model.config, "n_positions", None)
    seq_len = min(opts.seq_len, opts.batch_tokens)
    if max_pos and seq_len > max_pos:
        log.info("--seq-len %d exceeds the model's %d positions; using %d", seq_len, max_pos, max_pos)
        seq_len = max_pos
    batch = max(1, opts.batch_tokens // seq_len)
    return seq_len, batch


def finetune(opts, *, reporter_streams=None):
    """Run a fine-tuning job. Returns a dict with the records and the result."""
    import infinity
    from infinity.config import ConfigError
    from infinity.data import (ByteTokenizer, DataError, HFTokenizer, TokenBatcher, has_tokenizer,
                               load_texts)
    from infinity.finetune import checkpoints as ck
    from infinity.finetune import loop
    from infinity.checkpoint import model_meta
    from infinity.finetune.lora import param_counts
    from infinity.finetune.model import SHIPPED_MODELS, ModelError, check_vocab, resolve_model
    from infinity.finetune.report import Reporter, frozen_base_text, params_text
    from infinity.finetune.settings import SettingsError, build_config
    from infinity.finetune.stop import GracefulStop

    _validate(opts)
    rank, world, _ = dist_env()
    try:
        cfg, notes = build_config(config_path=opts.config, nvme_paths=opts.nvme_paths or None,
                                  lr=opts.lr, state_dtype=opts.state_dtype,
                                  frozen_dtype=opts.frozen_dtype,
                                  use_bench_io=opts.use_bench_io)
    except (SettingsError, ConfigError) as e:
        raise FinetuneError(str(e)) from e
    frozen_dtype = _check_frozen(opts, cfg)
    streams = reporter_streams or {}
    reporter = Reporter(total_steps=opts.steps, json_lines=opts.json_lines, enabled=(rank == 0),
                        drive_tbw=opts.drive_tbw, **streams)
    for n in notes:
        reporter.info(n)
    auto = _auto_plan(opts, cfg, world) if opts.auto else None
    if auto is not None:
        cfg = auto.config
        for line in auto.lines():
            reporter.info(line)
        cur = opts.curriculum or (cfg.get("curriculum_learning") or {}).get("enabled")
        if cur:
            # the schedule only ever shortens batches: the plan (activations, micro-batch)
            # is sized for its final, longest length, the run's sequence length
            reporter.info(f"auto: the curriculum grows the sequence to {auto.plan.model.seq} "
                          f"tokens; the plan is sized for that final length (shorter early "
                          f"steps use less memory and time than planned)")

    torch.manual_seed(opts.seed)
    own_pg = False
    swap_dirs = _missing_dirs(cfg["offload"]["nvme_paths"])  # removed at the end when left empty
    try:
        try:
            if opts.tokenizer == "auto" and opts.model and has_tokenizer(opts.model):
                tok = HFTokenizer(opts.model)
            else:
                tok = ByteTokenizer()
            texts = load_texts(opts.data)
            from infinity.zero.comm import ensure_process_group

            # before the model is built: Init shards it by rank
            own_pg = world > 1 and ensure_process_group(int(cfg.get("dist_timeout_s", 600)))
            if opts.curriculum:
                cfg = _with_curriculum(opts, cfg)   # before the run's identity, which records it
            lora = None
            if opts.lora is not None:
                if opts.model and opts.model not in SHIPPED_MODELS \
                        and not os.path.exists(opts.model):
                    resolve_model(opts.model)   # its ModelError (what --model accepts)
                lora = _lora_spec(opts)
            run_id = _run_identity(opts, cfg, auto, tok, lora) if opts.save else None
            resume_from = _check_save_dir(opts, run_id, rank, world, reporter) if opts.save \
                else None
            # a quantized frozen base is built under infinity.Init like any other and
            # quantized group by group as initialize adopts it
            model, desc = resolve_model(opts.model, init_config=cfg)
            check_vocab(model, tok)
            base_meta = model_meta(model, tokenizer=tok.describe())
            if lora is not None:
                from infinity.finetune.lora import apply_lora

                model = apply_lora(model, lora)
            seq_len, batch = _shape(opts, model)
            if auto is not None:
                batch = auto.micro_batch
                if auto.checkpointing:
                    # transformers 5 renamed it (the old name warns as deprecated)
                    enable = getattr(model, "activation_checkpointing_enable", None) or \
                        model.gradient_checkpointing_enable
                    enable()
                    model.train()
            batcher = TokenBatcher(texts, tok, seq_len=seq_len, batch_size=batch, rank=rank,
                                   world_size=world, seed=opts.seed)
        except (DataError, ModelError) as e:
            raise FinetuneError(str(e)) from e
        except OSError as e:  # infinity.Init cannot create its swap directory, no free space, ...
            from infinity.memory.plan import NvmeSpaceError

            if isinstance(e, NvmeSpaceError):
                raise FinetuneError(e.strerror) from e
            raise FinetuneError(f"cannot build the model into its offloaded home: {e}") from e
    except BaseException:
        remove_if_empty(swap_dirs)
        raise
    n_params = sum(p.numel() for p in model.parameters())
    n_trainable, n_total = param_counts(model)
    run_info = {"trainable_params": n_trainable, "total_params": n_total}
    if frozen_dtype:
        run_info["frozen_dtype"] = frozen_dtype
    reporter.set_run_info(run_info)
    gas = int(cfg.get("gradient_accumulation_steps", 1) or 1)
    if lora is not None:
        reporter.info(f"lora: {lora.describe()} | "
                      + params_text(n_trainable, n_total, "the adapters, over a frozen base"))
    reporter.info(
        f"model {desc}: {n_params / 1e6:.2f} M params | tokenizer "
        f"{'byte-level' if isinstance(tok, ByteTokenizer) else tok.path} | "
        f"data {opts.data or 'shipped corpus'}: "
        f"{batcher.num_tokens:,} tokens | batch {batch} x {seq_len} tokens x {gas} micro x "
        f"{world} rank(s) | offload.params {cfg['offload']['params']}, offload.optimizer "
        f"{cfg['offload']['optimizer']}, swap {cfg['offload']['nvme_paths']}")

    curriculum = _curriculum(cfg, seq_len, reporter)

    from infinity.curriculum import STATE_KEY as CURRICULUM_KEY
    from infinity.finetune.identity import META_KEY as RUN_META_KEY

    checkpointer = ck.Checkpointer(opts.save, keep_last=opts.keep_last, is_rank0=(rank == 0),
                                   extra_meta=dict(base_meta, **{RUN_META_KEY: run_id},
                                                   **({"lora": lora.identity()} if lora
                                                      else {})),
                                   step_meta=(lambda s: {CURRICULUM_KEY: curriculum.state_dict(s)})
                                   if curriculum is not None else None) \
        if opts.save else None
    t_start = time.perf_counter()
    result = None
    aborted = False
    stopper = GracefulStop()
    try:
        with stopper:
            timeline = None
            if opts.profile:
                from infinity.profile import Timeline

                timeline = Timeline(rank=rank)  # disabled until the profile session enables it
            try:
                engine = infinity.initialize(model, cfg, timeline=timeline)
            except (OSError, ValueError, MemoryError, NotImplementedError) as e:
                # swap path not writable, disk full, budgets too small, a quantized frozen
                # base in a set-up it does not support yet: the message says what to do
                raise FinetuneError(f"cannot set up the offload engine: {e}") from e
            # the placement in one line, as the Trainer integration prints it
            reporter.info(f"placement: {engine.placement.summary()}")
            try:
                del model  # the engine owns the parameters now
                start = 0
                if resume_from is not None or opts.resume:
                    from infinity.checkpoint.errors import CheckpointError

                    try:
                        start = checkpointer.resume(engine)
                    except CheckpointError as e:  # corrupt/incomplete/incompatible checkpoint
                        raise FinetuneError(f"{_save_flag(opts)}: {e}; to start over: "
                                           f"{_ways_out(opts.save)}") \
                            from e
                    reporter.set_initial(start)
                    saved_cur = (checkpointer.loaded_meta or {}).get(CURRICULUM_KEY) \
                        if isinstance(checkpointer.loaded_meta, dict) else None
                    if curriculum is not None and saved_cur:
                        curriculum.load_state_dict(saved_cur)   # the length follows the step
                    if start >= opts.steps:
                        reporter.info(f"checkpoint is at step {start} >= --steps {opts.steps}: "
                                      "nothing to do")
                prof = None
                if opts.profile:
                    bench = None
                    if opts.use_bench_io:
                        from infinity.finetune.settings import find_bench_io_result

                        bench, _ = find_bench_io_result(cfg["offload"]["nvme_paths"])
                    prof = _WarmProfile(
                        lambda note: _profile_session(engine, timeline, opts.profile, rank, bench,
                                                      note=note),
                        start, opts.steps, opts.profile_skip, curriculum=curriculum)
                lopts = loop.LoopOptions(steps=opts.steps, start_step=start, grad_accum=gas,
                                         save_every=opts.save_every, world_size=world,
                                         curriculum=curriculum)
                with prof or contextlib.nullcontext():
                    result = loop.run(engine, batcher, lopts, reporter, stopper, checkpointer,
                                      timeline=timeline,
                                      on_step_start=prof.before_step if prof else None)
                if opts.output and result.last_step > 0:
                    from infinity.finetune.output import write_output

                    try:
                        write_output(engine, opts.output, tok, rank=rank, world_size=world,
                                     lora=lora is not None,
                                     base_dir=opts.model if opts.model
                                     and os.path.isdir(opts.model) else None)
                    except OSError as e:
                        raise FinetuneError(f"--output {opts.output}: cannot write the model: "
                                            f"{e}") from e
                stats = engine.stats()
                from infinity.finetune.lora import frozen_format

                frozen_fmt = frozen_format(engine)
            finally:
                stopper.finish()
                _close_uninterrupted(engine)
            # still under the stopper: a late Ctrl-C is logged, not a traceback mid-summary
            extra = {"wall time": f"{time.perf_counter() - t_start:.1f} s"}
            peaks = _peaks(stats)
            if peaks:
                extra["peak memory"] = peaks
            if result.saved:
                extra["checkpoints"] = f"{opts.save}: {', '.join(result.saved)}"
            extra["params"] = params_text(n_trainable, n_total,
                                          lora.describe() if lora is not None else None)
            if lora is not None:
                read = sum(int(stats.get(k) or 0) for k in ("frozen_nvme_read_bytes",
                                                            "frozen_host_read_bytes")) \
                    if isinstance(stats, dict) else None
                extra["frozen base"] = frozen_base_text(frozen_fmt, working=cfg.get(
                    "precision", "fp32"), read_bytes=read)
            if opts.output and result.last_step > 0 and lora is not None:
                base = f"--model {opts.model}" if opts.model and os.path.isdir(opts.model) \
                    else f"{os.path.join(opts.output, 'base')}"
                extra["model"] = (f"{opts.output}: LoRA adapters over the base {base} "
                                  "(peft.AutoPeftModelForCausalLM.from_pretrained(DIR) loads "
                                  "both, PeftModel.from_pretrained(base, DIR) the adapters)")
            elif opts.output and result.last_step > 0:
                extra["model"] = (f"{opts.output} (AutoModelForCausalLM.from_pretrained / "
                                  "AutoTokenizer.from_pretrained load it)")
            elif result.last_step > 0 and lora is not None:
                extra["model"] = "not written: pass --output DIR for the LoRA adapters"
            elif result.last_step > 0:
                extra["model"] = ("not written: pass --output DIR for a directory "
                                  "from_pretrained loads" + (f", or `infinity export {opts.save} "
                                                             "OUT`" if result.saved else ""))
            if opts.profile:
                extra["profile"] = opts.profile
            if result.stop_reason != "completed":
                extra["resume"] = _resume_hint(opts, world)
            if auto is not None:
                extra["auto"] = _auto_check(auto, reporter.records)
            reporter.summary(stop_reason=None if result.stop_reason == "completed"
                             else result.stop_reason, extra=extra)
    except ck.CheckpointUnavailable as e:
        raise FinetuneError(str(e)) from e
    except BaseException as e:
        # A second Ctrl-C may surface wrapped (e.g. raised inside an autograd hook).
        if not (isinstance(e, KeyboardInterrupt) or stopper.aborted):
            raise
        aborted = True
        reporter.summary(stop_reason="aborted by a second Ctrl-C (engine closed, swap removed)")
        raise KeyboardInterrupt from None
    finally:
        if not aborted and result is None:
            reporter.close()
        remove_if_empty(swap_dirs)
        if own_pg:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
    return {"records": reporter.records, "result": result, "stats": stats, "auto": auto}


class _WarmProfile:
    """``--profile`` that starts after ``--profile-skip`` warm-up steps of this run: the first
    step records the module order (every fetch is on demand) and pays one-time set-up, which
    would drag the prefetch hit rate and the bandwidths down without saying so. When the run
    has no more steps than that, the last step is profiled. The summary names the steps."""

    def __init__(self, make, start_step, last_step, skip, curriculum=None):
        n_run = max(0, last_step - start_step)
        self.skip = min(skip, max(0, n_run - 1))
        self.first = start_step + self.skip + 1
        self.make = make
        self.session = None
        if self.skip == 0:
            self.note = None if skip == 0 else \
                f"no warm-up step skipped (the run has {n_run} step(s), --profile-skip {skip})"
        else:
            a, b = start_step + 1, start_step + self.skip
            skipped = f"step {a}" if a == b else f"steps {a}-{b}"
            self.note = (f"{skipped} left out as warm-up (--profile-skip {skip}; the first step "
                         "records the module order, so its fetches are on demand)")
        if curriculum is not None:      # the sequence length of each profiled step
            lengths = ", ".join(str(curriculum.length(s - 1))
                                for s in range(self.first, last_step + 1))
            cur = (f"curriculum: sequence length of steps {self.first}-{last_step}: {lengths}"
                   if last_step > self.first else
                   f"curriculum: sequence length of step {self.first}: {lengths}")
            self.note = cur if self.note is None else f"{self.note}; {cur}"

    def before_step(self, step_no):
        if self.session is None and step_no >= self.first:
            self.session = self.make(self.note)
            self.session.__enter__()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.session is not None:
            return self.session.__exit__(*exc)
        return False


def _with_curriculum(opts, cfg):
    """``cfg`` with the ``curriculum_learning`` block of ``--curriculum`` (it replaces one from
    ``--config``), growing to the run's sequence length."""
    from types import SimpleNamespace

    from infinity.config import ConfigError, InfinityConfig
    from infinity.curriculum import cli_block
    from infinity.finetune.auto import model_config_path
    from infinity.finetune.model import load_model_config

    seq_len, _ = _shape(opts, SimpleNamespace(config=load_model_config(
        model_config_path(opts.model))))
    try:
        out = dict(cfg, curriculum_learning=cli_block(opts.curriculum, seq_len))
        InfinityConfig.load(out)
    except ConfigError as e:
        raise FinetuneError(f"--curriculum {opts.curriculum}: {e}") from e
    except ValueError as e:   # cli_block's own messages name the flag
        raise FinetuneError(str(e)) from e
    return out


def _curriculum(cfg, seq_len, reporter):
    """The run's :class:`infinity.curriculum.SeqlenSchedule` (None without an enabled
    ``curriculum_learning`` block), announced in one info line."""
    from infinity.config import InfinityConfig
    from infinity.curriculum import schedule_from_config

    sched = schedule_from_config(InfinityConfig.load(cfg))
    if sched is None:
        return None
    reporter.info(f"curriculum: {sched.describe()}; batches truncated to the step's length")
    if sched.max_length > seq_len:
        reporter.info(f"curriculum: max_difficulty {sched.max_length} exceeds the run's sequence "
                      f"length {seq_len}: lengths past it leave the batches whole")
    return sched


def _ways_out(save):
    return (f"--restart (moves the old checkpoints into {save}/previous-<UTC time>/, deletes "
            "nothing) or another --save DIR")


def _save_flag(opts):
    return "--resume" if opts.resume else f"--save {opts.save}"


def _run_identity(opts, cfg, auto, tok, lora=None):
    """This run's identity (:mod:`infinity.finetune.identity`), from the model's config
    (micro-batch and sequence length as :func:`_shape` will set them) before it is built."""
    from types import SimpleNamespace

    from infinity.finetune.auto import model_config_path
    from infinity.finetune.identity import run_identity
    from infinity.finetune.model import DEFAULT_MODEL, SHIPPED_MODELS, load_model_config

    spec = opts.model or DEFAULT_MODEL
    if spec not in SHIPPED_MODELS and not os.path.exists(spec):
        from infinity.finetune.model import resolve_model

        resolve_model(spec)  # raises its ModelError (what --model accepts), builds nothing
    seq_len, batch = _shape(opts, SimpleNamespace(config=load_model_config(
        model_config_path(opts.model))))
    if auto is not None:
        batch = auto.micro_batch
    gas = int(cfg.get("gradient_accumulation_steps", 1) or 1)
    try:
        return run_identity(opts, cfg, micro_batch=batch, grad_accum=gas, seq_len=seq_len,
                            tokenizer=tok.describe(), lora=lora)
    except OSError as e:
        raise FinetuneError(f"cannot read the model or data to identify this run: {e}") from e


def _check_save_dir(opts, run_id, rank, world, reporter):
    """Resume by default. Returns the checkpoint tag to resume from (None: start at step 1);
    raises :class:`FinetuneError` when ``--save`` holds another run's checkpoints."""
    from infinity.finetune import checkpoints as ck
    from infinity.finetune.identity import differences

    save = opts.save
    if opts.restart:
        err = None
        if rank == 0:
            try:
                dest = ck.move_aside(save)
            except OSError as e:
                err = e
            else:
                reporter.info(f"--restart: moved the earlier checkpoints into {dest}; starting at "
                              "step 1" if dest else f"--restart: {save} holds no checkpoints; "
                              "starting at step 1")
        if world > 1:
            import torch
            import torch.distributed as dist

            # the other ranks see the directory only after the move, and learn whether it
            # failed (then every rank stops, none trains alone into a barrier)
            failed = torch.tensor([1.0 if err is not None else 0.0])
            dist.all_reduce(failed)
            if failed.item() and rank != 0:
                raise FinetuneError(f"--restart: rank 0 could not move the checkpoints in {save} "
                                    f"aside (its error says why); nothing was trained")
        if err is not None:
            raise FinetuneError(f"--restart: cannot move the checkpoints in {save} aside: {err}")
        return None
    state = ck.inspect_save_dir(save)
    if state.tag is None:
        return None  # nothing saved yet (--resume warns about that when the engine is up)
    if state.error:
        raise FinetuneError(f"{_save_flag(opts)}: the latest checkpoint cannot be resumed: "
                            f"{state.error}; to start over: {_ways_out(save)}")
    if state.run is None and not opts.resume:
        raise FinetuneError(f"--save {save} holds checkpoints (latest {state.tag}) that do not "
                            "record which run wrote them (an older infinity): pass --resume to "
                            f"continue from them; to start over: {_ways_out(save)}")
    diffs = differences(state.run, run_id) if state.run is not None else []
    if diffs:
        raise FinetuneError(f"--save {save} holds checkpoints of a different run (latest "
                            f"{state.tag}): " + "; ".join(diffs) + ". To start this run: "
                            f"{_ways_out(save)}; to continue that one, use its settings")
    if state.step < opts.steps:
        same = "the same run" if state.run is not None else "--resume: the run is not recorded"
        reporter.info(f"resuming from step {state.step} ({os.path.join(save, state.tag)}, "
                      f"{same}); --restart starts over")
    return state.tag


def _resume_hint(opts, world):
    """The summary's ``resume`` row after a stop: the command that continues the run."""
    if not opts.save:
        return "not resumable: no --save DIR (pass --save DIR to continue after a stop)"
    if opts.command:
        cmd = opts.command
        if world > 1:
            return f"run the same torchrun command again ({cmd})"
        return cmd
    return f"run finetune again with the same options and --save {opts.save}"


def _auto_plan(opts, cfg, world):
    """``--auto``: the plan for this machine (infinity.finetune.auto), for the run's batch:
    ``--batch-tokens`` / seq per micro-batch x the config's accumulation x ranks."""
    from types import SimpleNamespace

    from infinity.finetune.auto import make_auto_plan, model_config_path
    from infinity.finetune.model import ModelError, load_model_config

    from infinity.estimate.machine import detect_gpus

    if world > 1 and not detect_gpus():
        raise FinetuneError(f"--auto plans one process per CPU-only node (the estimator models "
                            f"ranks as GPUs); this run has {world} ranks without GPUs: run it "
                            "as one process, or plan with `infinity estimate --plan` and pass "
                            "the config")
    try:
        config = load_model_config(model_config_path(opts.model))
        seq_len, batch = _shape(opts, SimpleNamespace(config=config))
        gas = int(cfg.get("gradient_accumulation_steps", 1) or 1)
        return make_auto_plan(opts, cfg, seq_len=seq_len, global_batch=batch * gas * world,
                              allow_lossy=opts.allow_lossy)
    except (ModelError, ValueError) as e:
        raise FinetuneError(str(e)) from e


def _auto_check(auto, records):
    """The plan's predicted step time against the measured median (the first step, which
    records the module order and writes the optimizer states once, left out)."""
    times = [r["step_time_s"] for r in records[1:]] or [r["step_time_s"] for r in records]
    if not times:
        return f"predicted {auto.predicted_step_s:.3g} s per step (no step measured)"
    import statistics

    med = statistics.median(times)
    return (f"predicted {auto.predicted_step_s:.3g} s per step, measured median {med:.3g} s "
            f"(ratio {auto.predicted_step_s / med:.2f}); predicted host "
            f"{auto.predicted_host_bytes / 1e6:.1f} MB, NVMe {auto.predicted_nvme_bytes / 1e6:.1f} MB")


def _missing_dirs(paths):
    """The swap directories (and missing ancestors), deepest first, that this run will
    create: ``infinity.Init`` makes ``<path>/init`` (so ``<path>`` too) before the engine
    looks, so the engine thinks ``<path>`` was there and leaves it; the run removes it."""
    out = []
    for p in paths:
        d = os.path.abspath(p)
        while d and not os.path.exists(d) and d not in out:
            out.append(d)
            d = os.path.dirname(d)
    return sorted(out, key=len, reverse=True)


def _profile_session(engine, timeline, directory, rank, bench_io_file=None, note=None):
    """``engine.profile(dir)`` when the engine has it, else a ``ProfileSession`` over the
    timeline given to ``initialize`` (with the bench-io result, if any, as the GB/s
    ceiling). Each rank > 0 writes to ``dir/rank<r>``."""
    if rank:
        directory = os.path.join(directory, f"rank{rank}")
    try:
        makedirs(directory)
    except OSError as e:
        raise FinetuneError(f"--profile: cannot create {directory}: {e.strerror or e}") from e
    if hasattr(engine, "profile"):
        return engine.profile(directory, ceilings=bench_io_file, note=note)
    from infinity.profile import ProfileSession

    return ProfileSession(timeline, directory, stats_fn=engine.stats, ceilings=bench_io_file,
                          note=note)


def _close_uninterrupted(engine):
    """``engine.close()`` with SIGINT/SIGTERM held off, so an impatient second
    Ctrl-C cannot leave swap files behind. A signal arriving meanwhile is only
    logged: the run is ending anyway."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        engine.close()
        return
    pending = []
    sigs = (signal.SIGINT, signal.SIGTERM)
    previous = {s: signal.signal(s, lambda signum, frame: pending.append(signum)) for s in sigs}
    try:
        engine.close()
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
    if pending:
        log.warning("signal received while closing the engine: ignored, the run is ending")


def _peaks(stats):
    """"device 1.2 MB, host 30.0 MB, nvme 52.4 MB" from the ``<tier>_peak_bytes`` stats."""
    if not isinstance(stats, dict):
        return ""
    parts = [f"{t} {stats[f'{t}_peak_bytes'] / 1e6:.1f} MB" for t in ("device", "host", "nvme")
             if isinstance(stats.get(f"{t}_peak_bytes"), (int, float))]
    return ", ".join(parts)
