"""`infinity finetune`: argument parsing and wiring (the work is in infinity.finetune)."""
from .argtypes import nonneg_int, positive_int


def register(sub):
    p = sub.add_parser(
        "finetune", help="fine-tune a causal LM with params and optimizer offloaded to NVMe",
        description="Fine-tune a causal language model with the infinity engine. With no "
                    "arguments: a small Llama built from a shipped config, trained on a shipped "
                    "public-domain corpus, params and optimizer homed on NVMe under ./infinity-swap. "
                    "Runs under torchrun for several ranks (rank 0 reports). See docs/finetune.md.")
    p.add_argument("--model", metavar="NAME_OR_DIR",
                   help="tiny-llama (default) | tiny-gpt2 | a Hugging Face config .json (random "
                        "init) | a local Hugging Face directory with config.json + safetensors")
    p.add_argument("--data", metavar="PATH",
                   help="a text file, a directory of .txt/.jsonl files, or a .jsonl file with a "
                        "'text' field (default: the shipped corpus)")
    p.add_argument("--tokenizer", choices=("auto", "byte"), default="auto",
                   help="auto (default): the tokenizer saved in the --model directory if there is "
                        "one, else byte-level; byte: always byte-level")
    p.add_argument("--config", metavar="FILE", help="infinity config (JSON/YAML); flags override it")
    p.add_argument("--nvme-path", metavar="DIR", action="append", dest="nvme_paths", default=[],
                   help="swap directory (repeat to stripe over several); overrides offload.nvme_paths")
    p.add_argument("--steps", type=positive_int, default=30, metavar="N", help="optimizer steps (default 30)")
    p.add_argument("--batch-tokens", type=positive_int, default=4096, metavar="T",
                   help="tokens per micro-batch per rank (default 4096)")
    p.add_argument("--seq-len", type=positive_int, default=256, metavar="L",
                   help="sequence length (default 256, capped by the model)")
    p.add_argument("--lr", type=float, metavar="X", help="learning rate (default 3e-3 or the config's)")
    p.add_argument("--state-dtype", choices=("fp32", "bf16"),
                   help="optimizer.state_dtype: the Adam moments in fp32 (default, or the config's) "
                        "or bf16 (half their bytes on NVMe and in memory; the fp32 master is kept)")
    p.add_argument("--curriculum", metavar="seqlen:START:STEPS[:KIND]",
                   help="sequence-length warm-up: batches truncated to START tokens at first, "
                        "growing to --seq-len over STEPS optimizer steps; KIND linear (default), "
                        "root (square root) or discrete (doubling lengths); overrides a "
                        "curriculum_learning block of --config (docs/finetune.md)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed for data order and init (default 0)")
    p.add_argument("--output", metavar="DIR",
                   help="write the fine-tuned model and its tokenizer here at the end (and on Ctrl-C) "
                        "as a Hugging Face directory: AutoModelForCausalLM.from_pretrained(DIR) and "
                        "AutoTokenizer.from_pretrained(DIR) load it")
    p.add_argument("--save", metavar="DIR",
                   help="checkpoint directory (saved at the end and on Ctrl-C); when it holds "
                        "checkpoints of the same run (model, data, training settings; --steps may "
                        "grow), the run resumes from the latest, and another run is refused")
    p.add_argument("--save-every", type=nonneg_int, default=0, metavar="N",
                   help="also save every N steps")
    p.add_argument("--keep-last", type=nonneg_int, default=0, metavar="K",
                   help="keep only the K newest checkpoints (0: keep all)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint in --save DIR (the default; also "
                        "accepts checkpoints written before runs were recorded)")
    p.add_argument("--restart", action="store_true",
                   help="start over at step 1: move the checkpoints in --save DIR into "
                        "DIR/previous-<UTC time>/ first (nothing is deleted)")
    p.add_argument("--profile", metavar="DIR", help="write a timeline (Chrome trace, PNG, summary) to DIR")
    p.add_argument("--profile-skip", type=nonneg_int, default=1, metavar="N",
                   help="leave the first N steps of the run out of --profile as warm-up (default 1: "
                        "the first step records the module order, so its fetches are on demand)")
    p.add_argument("--json", action="store_true",
                   help="stdout: one JSON object per step and nothing else (progress goes to stderr)")
    p.add_argument("--auto", action="store_true",
                   help="plan the run for this machine (`infinity estimate --plan`): offload homes, "
                        "activation checkpointing and offload, micro-batch x accumulation (their "
                        "product stays --batch-tokens / --seq-len x the config's accumulation), "
                        "prefetch depth; the plan overrides those keys of --config")
    p.add_argument("--allow-lossy", action="store_true",
                   help="with --auto: the plan may use bf16 Adam moments and bf16 gradient partial sums")
    p.add_argument("--drive-tbw", type=float, metavar="TB",
                   help="the swap drives' rated total TB written: the summary gives their life "
                        "in steps and tokens at this run's rate (always: TB written per step)")
    g = p.add_argument_group(
        "LoRA", "train low-rank adapters (PEFT) over a frozen base instead of every weight; "
                "--output then writes the adapters as PEFT does (docs/finetune.md#lora)")
    g.add_argument("--lora", type=int, metavar="R",
                   help="LoRA rank (>= 1); absent: full fine-tuning")
    g.add_argument("--lora-targets", nargs="+", metavar="NAME",
                   help="module-name suffixes to adapt, as PEFT's target_modules (default: "
                        "every nn.Linear / Conv1D but the LM head: the attention and MLP "
                        "projections)")
    g.add_argument("--lora-alpha", type=float, metavar="A",
                   help="LoRA scaling numerator (default 2 x R; the update is scaled by A/R)")
    g.add_argument("--lora-dropout", type=float, metavar="P",
                   help="dropout on the adapters' input (default 0.0)")
    g.add_argument("--frozen-dtype", choices=("nf4", "int8", "int4"),
                   help="offload.frozen_weights.dtype: keep the frozen base quantized at its "
                        "home (NVMe by default), dequantized just before use; needs --lora")
    p.add_argument("--no-bench-io", action="store_true",
                   help="ignore a saved `infinity bench-io --sweep --save` result")
    p.set_defaults(func=run)


def run(args):
    from infinity.cli.main import CLIError
    from infinity.finetune.run import FinetuneError, FinetuneOptions, finetune

    opts = FinetuneOptions(model=args.model, data=args.data, config=args.config,
                           nvme_paths=args.nvme_paths, steps=args.steps,
                           batch_tokens=args.batch_tokens, seq_len=args.seq_len, lr=args.lr,
                           state_dtype=args.state_dtype,
                           save=args.save, output=args.output, save_every=args.save_every, keep_last=args.keep_last,
                           resume=args.resume, restart=args.restart,
                           command=_command_line(), profile=args.profile,
                           profile_skip=args.profile_skip, json_lines=args.json,
                           seed=args.seed, use_bench_io=not args.no_bench_io,
                           tokenizer=args.tokenizer, auto=args.auto,
                           allow_lossy=args.allow_lossy, curriculum=args.curriculum,
                           drive_tbw=args.drive_tbw, lora=args.lora,
                           lora_targets=args.lora_targets, lora_alpha=args.lora_alpha,
                           lora_dropout=args.lora_dropout, frozen_dtype=args.frozen_dtype)
    if args.allow_lossy and not args.auto:
        raise CLIError("--allow-lossy goes with --auto")
    try:
        finetune(opts)
    except FinetuneError as e:
        raise CLIError(str(e)) from e
    finally:
        _ignore_late_interrupts()
    return 0


def _command_line(argv=None):
    """The command that resumes this run: the same command line (without ``--restart``,
    which would start over again); None when ``main(argv)`` was called from Python."""
    import os
    import shlex
    import shutil
    import sys

    argv = list(sys.argv if argv is None else argv)
    if "finetune" not in argv[1:]:
        return None
    prog = argv[0]
    if prog.endswith(".py") or prog == "-m":
        head = [sys.executable, "-m", "infinity"]
    else:
        name = os.path.basename(prog)
        found = shutil.which(name)
        same = found and os.path.realpath(found) == os.path.realpath(prog)
        head = [name if same else prog]
    return shlex.join(head + [a for a in argv[1:] if a != "--restart"])


def _ignore_late_interrupts():
    """The run is over (engine closed, swap removed, summary printed): a Ctrl-C from here on
    would only interrupt the interpreter's exit and print a traceback from an atexit hook."""
    import signal
    import threading
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
