"""`infinity estimate`: memory per tier and step time for every offload configuration.

    infinity estimate --params 1T --layers 128 --hidden 25600 --vocab 51200 --heads 160 \\
        --gpus 8 --gpu-mem 80 --host-mem 2000 --nvme-gb 30720 --nvme-drives 8 --nvme-gbps 48

See docs/estimator.md for the formulas and their sources.
"""
import argparse
import json
import os
import re

from infinity.cli.main import CLIError

#: exit status when nothing fits (the output still says what came closest); docs/estimator.md
NO_FIT = 1

_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "g": 10**9, "t": 10**12}


def parse_count(text):
    """'1T', '7B', '125M', '350k', '1e12', '1_000' -> int."""
    s = str(text).strip().lower().replace("_", "").replace(",", "")
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmbgt]?)", s)
    if not m:
        raise CLIError(f"cannot read the count {text!r}: write e.g. 1T, 7B, 125M or 1e9")
    v = float(m.group(1)) * _SUFFIX[m.group(2)]
    if v < 1 or v != int(v):
        raise CLIError(f"count {text!r} must be a positive whole number")
    return int(v)


# (params, layers, hidden, vocab, heads, name): shapes to suggest when only --params is given
_SHAPES = [(125e6, 12, 768, 50257, 12, "GPT-2 small / OPT-125M"), (1.3e9, 24, 2048, 50272, 32, "OPT-1.3B"),
           (7e9, 32, 4096, 32000, 32, "Llama-2-7B"), (13e9, 40, 5120, 32000, 40, "Llama-2-13B"),
           (70e9, 80, 8192, 32000, 64, "Llama-2-70B"), (175e9, 96, 12288, 50257, 96, "GPT-3 175B"),
           (1e12, 128, 25600, 51200, 160, "a 1T GPT (ZeRO-Infinity paper)")]


def missing_shape_message(params, layers, hidden):
    """What to add when the model is described by --params alone (or without its shape)."""
    import math
    need = [f for f, v in (("--layers L", layers), ("--hidden H", hidden)) if v is None]
    n = params if params is not None else 7e9
    p, L, H, V, A, name = min(_SHAPES, key=lambda s: abs(math.log(s[0] / n)))
    eg = f"e.g. --params {_fmt_count(p)} --layers {L} --hidden {H} --vocab {V} --heads {A}, " \
        f"the shape of {name}"
    if params is None:
        return (f"describe the model: add --params N --layers L --hidden H ({eg}); --vocab, "
                "--heads, --seq, --batch are optional. Or count a real model: "
                "--model-factory MODULE:FUNCTION")
    given = f"--params {_fmt_count(params)}" + (f" --layers {layers}" if layers else "") + \
        (f" --hidden {hidden}" if hidden else "")
    eg = f"e.g. --layers {L} --hidden {H} --vocab {V} --heads {A}, the shape of {name}"
    return (f"{given} is not enough to size activations and groups: add {' '.join(need)} ({eg}); "
            "--vocab, --heads, --seq, --batch are optional. Or count a real model: "
            "--model-factory MODULE:FUNCTION")


def _fmt_count(n):
    for div, suf in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= div:
            return f"{n / div:g}{suf}"
    return str(n)


def _home_pair(text):
    parts = text.split("/")
    if len(parts) != 2 or any(p not in ("none", "cpu", "nvme") for p in parts):
        raise CLIError(f"--only expects PARAMS/OPTIMIZER homes such as nvme/nvme or none/cpu, got {text!r}")
    return tuple(parts)


def register(sub):
    p = sub.add_parser(
        "estimate", help="estimate memory per tier and step time for each offload configuration",
        description="Estimate what each offload configuration needs per tier (device, pinned host, "
                    "pageable host, NVMe), which fit this (or a described) machine, and a "
                    "bandwidth-bound step time with its derivation. Sizes in GB = 10^9 bytes.")
    m = p.add_argument_group("model (dimensions or a factory)")
    m.add_argument("--params", type=str, help="parameter count, e.g. 1T, 70B, 1.3e9")
    m.add_argument("--layers", type=int, help="transformer layers")
    m.add_argument("--hidden", type=int, help="hidden size")
    m.add_argument("--vocab", type=int, help="vocabulary size (logits activations)")
    m.add_argument("--heads", type=int, help="attention heads (default hidden/128)")
    m.add_argument("--seq", type=int, default=2048, help="sequence length (default 2048)")
    m.add_argument("--batch", type=int, help="micro-batch per rank (default 1; with --plan: searched)")
    m.add_argument("--model-factory", metavar="MODULE:FUNCTION",
                   help="build the model with this function on the meta device and count it "
                        "(also 'path/to/file.py:function')")
    h = p.add_argument_group(
        "machine (defaults: this machine; describing GPUs with --gpus N also needs --host-mem "
        "and --nvme-gb)")
    h.add_argument("--gpus", type=int, help="GPUs per node (default: detected; 0 = CPU only)")
    h.add_argument("--gpu-mem", type=float, help="GB per GPU (default 80)")
    h.add_argument("--host-mem", type=float,
                   help="RAM per node in GB (default: this machine's, only when --gpus is not given)")
    h.add_argument("--nvme-gb", type=float,
                   help="NVMe GB per node for swap (default: free space at --nvme-path, only when "
                        "--gpus is not given)")
    h.add_argument("--nvme-path", default="./infinity-swap", help="where to measure free space (default ./infinity-swap)")
    h.add_argument("--nvme-drives", type=int, default=1, help="NVMe drives per node (default 1)")
    h.add_argument("--nvme-gbps", type=float, help="aggregate NVMe read GB/s per node (default 3 per drive)")
    h.add_argument("--nvme-write-gbps", type=float, help="aggregate NVMe write GB/s (default: = read)")
    h.add_argument("--bench-io", metavar="FILE",
                   help="take NVMe read/write GB/s from a saved `infinity bench-io --sweep --save FILE`")
    h.add_argument("--pcie-gbps", type=float, help="host<->GPU GB/s per GPU (default 25)")
    h.add_argument("--tflops", type=float, help="achieved TFLOPS per GPU (default 150; 0.2 CPU-only)")
    h.add_argument("--interconnect-gbps", type=float, help="collective GB/s per GPU (default 100)")
    h.add_argument("--inter-node-gbps", type=float,
                   help="collective GB/s per GPU to other nodes (default: --interconnect-gbps)")
    h.add_argument("--cpu-adam-gps", type=float, help="CPU Adam 10^9 params/s per node (default 4)")
    h.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    h.add_argument("--host-mem-gbps", type=float,
                   help="GPU nodes: host DRAM GB/s per node that NVMe DMA, PCIe copies and CPU "
                        "Adam share (default 200)")
    h.add_argument("--gpus-per-pcie-link", type=int,
                   help="GPUs sharing one PCIe link to the host (default 2 on a node of 8+ GPUs, "
                        "else 1)")
    k = p.add_argument_group("infinity settings")
    k.add_argument("--config", metavar="FILE", help="infinity config (JSON/YAML) to take settings from")
    k.add_argument("--precision", choices=("fp32", "bf16", "fp16"), help="default bf16 (or the config's)")
    k.add_argument("--zero-stage", type=int, choices=(1, 2, 3), help="default 3")
    k.add_argument("--prefetch-depth", type=int, help="groups fetched ahead (default 2)")
    k.add_argument("--grad-accum", type=int, help="gradient accumulation steps (default 1)")
    k.add_argument("--host-cap", type=float, metavar="GB", help="offload.host_memory_gb cap")
    k.add_argument("--tiling-max-group-gb", type=float, metavar="GB",
                   help="tiling.max_group_gb: groups above it computed tile by tile (default: "
                        "the config's, or no tiling; --plan tries tiles itself)")
    k.add_argument("--reduce-bucket-mb", type=float, metavar="MB",
                   help="reduce_bucket_mb: ZeRO stages 2-3 reduce gradients on the GPU in "
                        "buckets of this size (default 128, or the config's; 0: whole groups)")
    k.add_argument("--commit-shadow-gb", type=float, metavar="GB",
                   help="offload.commit_shadow_gb: NVMe per rank for the shadows of all-or-nothing "
                        "updates (default: automatic, every shadow where the NVMe has room)")
    k.add_argument("--tile-numel", type=int, help="optimizer tile elements (default 4194304)")
    k.add_argument("--state-dtype", choices=("fp32", "bf16"),
                   help="optimizer.state_dtype: Adam moments in fp32 (default, or the config's) or bf16 "
                        "(half their bytes; the master stays fp32)")
    k.add_argument("--grouping", choices=("module", "block"), help="parameter groups (default module)")
    k.add_argument("--activations", choices=("megatron", "eager"),
                   help="activation model: megatron (fused GPU kernels, Korthikanti et al.) or eager "
                        "(PyTorch eager, measured); default eager CPU-only, megatron with GPUs")
    k.add_argument("--grad-spill", choices=("auto", "on", "off"), default="auto",
                   help="fp32 gradient home: auto (default) = as the engine decides (NVMe when the "
                        "host cap cannot hold them; the other home is shown for comparison), "
                        "on = NVMe whenever a swap space exists, off = always host memory")
    k.add_argument("--activation-offload", metavar="HOME[/SCOPE]",
                   help="activation_offload: cpu or nvme, scope checkpoints (default) or all, "
                        "e.g. nvme/all (default none)")
    k.add_argument("--grad-accum-dtype", choices=("fp32", "bf16"),
                   help="gradient_accumulation_dtype: bf16 = partial sums on NVMe in bf16 (lossy)")
    lo = p.add_argument_group("LoRA over a frozen base (docs/estimator.md, \"LoRA over a quantized base\")")
    lo.add_argument("--lora-rank", type=int, metavar="R",
                    help="LoRA adapters of rank R on every attention and MLP projection of each "
                         "layer; only they train (fp32 masters, Adam states, gradients), the "
                         "model's parameters are the frozen base")
    lo.add_argument("--frozen-dtype", choices=("bf16", "fp16", "fp32", "nf4", "int8", "int4"),
                    help="with --lora-rank: the frozen base at its home (offload.frozen_weights."
                         "dtype): nf4/int8/int4 quantized, or the working precision's name = not "
                         "quantized (the default)")
    lo.add_argument("--frozen-group-size", type=int, metavar="N",
                    help="with --lora-rank: elements per quantization block (default 64)")
    lo.add_argument("--double-quant", action="store_true",
                    help="with --lora-rank: quantize the block scales too (QLoRA's double "
                         "quantization)")
    lo.add_argument("--dequant-gbps", type=float, metavar="GBPS",
                    help="GB/s of working-precision output one rank dequantizes (default: the "
                         "engine's torch path on a GPU, ~116 GB/s for nf4 to bf16; measured CPU "
                         "kernel rates CPU-only)")
    k.add_argument("--only", action="append", metavar="PARAMS/OPTIMIZER",
                   help="estimate only these homes (repeatable), e.g. --only nvme/nvme")
    pl = p.add_argument_group("planner")
    pl.add_argument("--plan", action="store_true",
                    help="search homes, activation checkpointing and offload, micro-batch x "
                         "accumulation and prefetch depth for the fastest configuration that fits; "
                         "print it, its derivation and a ready config (--batch/--grad-accum pin them)")
    pl.add_argument("--allow-lossy", action="store_true",
                    help="with --plan: also search bf16 Adam moments (optimizer.state_dtype) and bf16 "
                         "gradient partial sums (gradient_accumulation_dtype)")
    pl.add_argument("--global-batch", type=int, metavar="SEQS",
                    help="with --plan: sequences per optimizer step across all ranks (default: "
                         "--batch x --grad-accum x ranks when both are given, else 262144 tokens "
                         "rounded up to whole sequences per rank)")
    pl.add_argument("--nvme-headroom", type=float, default=0.10, metavar="FRACTION",
                    help="with --plan: NVMe kept free (default 0.10)")
    pl.add_argument("--host-headroom", type=float, default=0.10, metavar="FRACTION",
                    help="with --plan: host memory kept free (default 0.10)")
    pl.add_argument("--nvme-derate", type=float, default=None, metavar="FACTOR",
                    help="with --plan: drive bandwidth times FACTOR (default 0.8; 1 with --bench-io: "
                         "measured here)")
    pl.add_argument("--no-clip", action="store_true",
                    help="with --plan: plan without gradient clipping (default: 1.0 unless the "
                         "config sets it)")
    pl.add_argument("--drive-tbw", type=float, metavar="TB",
                    help="with --plan: the node's drives' rated total TB written (all drives), for "
                         "their life in steps and tokens")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object")
    o.add_argument("--explain", action="store_true",
                   help="also print each configuration's items, formulas and the step-time derivation "
                        "(default: the summary table and the verdict)")
    o.add_argument("--brief", action="store_true", help=argparse.SUPPRESS)  # the default now
    p.set_defaults(func=run)


def _machine(args):
    """The Machine to plan for, each value's source recorded (described / detected / default).
    A machine described by its GPUs (--gpus N, N >= 1) must describe its RAM and disk too:
    this machine's are used only when no GPU is described."""
    from infinity.estimate.machine import (DEFAULT_GPU_MEM_GB, Machine, detect_free_disk_gb,
                                           detect_gpus, detect_host_mem_gb)
    from infinity.profile.summary import load_ceilings

    if args.gpus is not None and args.gpus >= 1:
        missing = [f for f, v in (("--host-mem GB", args.host_mem), ("--nvme-gb GB", args.nvme_gb))
                   if v is None]
        if missing:
            raise CLIError(f"--gpus {args.gpus} describes another machine: add {' and '.join(missing)} "
                           "(its RAM and NVMe per node); this machine's are used only without --gpus")
    src = {"gpus": "detected" if args.gpus is None else "described",
           "gpu_mem_gb": "default" if args.gpu_mem is None else "described",
           "host_mem_gb": "detected" if args.host_mem is None else "described",
           "nvme_gb": "detected" if args.nvme_gb is None else "described"}
    kw = {"gpus": detect_gpus() if args.gpus is None else args.gpus,
          "gpu_mem_gb": DEFAULT_GPU_MEM_GB if args.gpu_mem is None else args.gpu_mem,
          "host_mem_gb": round(detect_host_mem_gb(), 1) if args.host_mem is None else args.host_mem,
          "nvme_gb": (round(detect_free_disk_gb(os.path.expanduser(args.nvme_path)), 1)
                      if args.nvme_gb is None else args.nvme_gb),
          "nvme_drives": args.nvme_drives, "nodes": args.nodes}
    if args.bench_io:
        try:
            ceil = load_ceilings(args.bench_io)
        except (OSError, ValueError) as e:
            raise CLIError(str(e)) from e
        if "nvme_read" in ceil:
            kw["nvme_gbps"] = ceil["nvme_read"]
            src["nvme_gbps"] = "measured: --bench-io"
        if "nvme_write" in ceil:
            kw["nvme_write_gbps"] = ceil["nvme_write"]
            src["nvme_write_gbps"] = "measured: --bench-io"
    for arg, field in (("nvme_gbps", "nvme_gbps"), ("nvme_write_gbps", "nvme_write_gbps"),
                       ("pcie_gbps", "pcie_gbps"), ("tflops", "tflops"),
                       ("interconnect_gbps", "interconnect_gbps"), ("cpu_adam_gps", "cpu_adam_gparams"),
                       ("inter_node_gbps", "inter_node_gbps"), ("host_mem_gbps", "host_mem_gbps"),
                       ("gpus_per_pcie_link", "gpus_per_pcie_link"),
                       ("dequant_gbps", "dequant_gbps")):
        v = getattr(args, arg)
        if v is not None:
            kw[field] = v
            src[field] = "described"
        else:
            src.setdefault(field, "default")
    if "nvme_write_gbps" not in kw and "nvme_gbps" in kw:
        src["nvme_write_gbps"] = "= read"
    return Machine(**kw, sources=src)


def run(args):
    from infinity.config import ConfigError
    from infinity.estimate import EstimateError, estimate

    if args.plan:
        return run_plan(args)
    if args.allow_lossy or args.global_batch is not None or args.no_clip \
            or args.drive_tbw is not None or args.nvme_derate is not None:
        raise CLIError("--allow-lossy, --global-batch, --no-clip, --drive-tbw and --nvme-derate "
                       "go with --plan")
    if args.batch is None:
        args.batch = 1
    try:
        machine = _machine(args)
        model = args.model_factory
        params = parse_count(args.params) if args.params is not None else None
        if model is None and (params is None or args.layers is None or args.hidden is None):
            raise CLIError(missing_shape_message(params, args.layers, args.hidden))
        act_home, act_scope = _activation_offload(args)
        precision = args.precision
        if precision is None and args.config is None:
            precision = "bf16"
        est = estimate(model, params=params, layers=args.layers, hidden=args.hidden, seq=args.seq,
                       batch=args.batch, vocab=args.vocab, heads=args.heads, machine=machine,
                       config=args.config, precision=precision, zero_stage=args.zero_stage,
                       prefetch_depth=args.prefetch_depth, grad_accum=args.grad_accum,
                       host_cap_gb=args.host_cap, tile_numel=args.tile_numel,
                       commit_shadow_gb=args.commit_shadow_gb,
                       tiling_max_group_gb=args.tiling_max_group_gb,
                       reduce_bucket_mb=args.reduce_bucket_mb,
                       state_dtype=args.state_dtype, grouping=args.grouping,
                       grad_spill=args.grad_spill, activation_model=args.activations,
                       activation_home=act_home, activation_scope=act_scope,
                       grad_accum_dtype=args.grad_accum_dtype,
                       configs=[_home_pair(t) for t in args.only] if args.only else None,
                       **_lora_args(args))
    except (EstimateError, ConfigError) as e:
        raise CLIError(str(e)) from e
    if args.json:
        print(json.dumps(est.as_dict()))
    else:
        print(est.text(details=args.explain and not args.brief), end="")
    return 0 if est.best is not None else NO_FIT


def _lora_args(args):
    """The LoRA keywords of ``estimate()`` from the flags (unset: None)."""
    return {"lora_rank": args.lora_rank, "frozen_dtype": args.frozen_dtype,
            "frozen_group_size": args.frozen_group_size,
            "double_quant": True if args.double_quant else None}


def _activation_offload(args):
    if not args.activation_offload:
        return None, None
    home, _, scope = args.activation_offload.partition("/")
    return home, scope or "checkpoints"


def plan_inputs(args):
    """(ModelSpec, Machine, Knobs) of an `estimate` command line (for --plan)."""
    from infinity.estimate import knobs_from, spec_from_dims, spec_from_factory

    machine = _machine(args)
    params = parse_count(args.params) if args.params is not None else None
    if args.model_factory is None and (params is None or args.layers is None or args.hidden is None):
        raise CLIError(missing_shape_message(params, args.layers, args.hidden))
    if args.model_factory is not None:
        spec = spec_from_factory(args.model_factory, seq=args.seq, layers=args.layers,
                                 hidden=args.hidden, vocab=args.vocab, heads=args.heads)
    else:
        spec = spec_from_dims(params, args.layers, args.hidden, seq=args.seq, vocab=args.vocab,
                              heads=args.heads)
    precision = args.precision
    if precision is None and args.config is None:
        precision = "bf16"
    knobs = knobs_from(args.config, dict(precision=precision, zero_stage=args.zero_stage,
                                          host_cap_gb=args.host_cap, tile_numel=args.tile_numel,
                                          commit_shadow_gb=args.commit_shadow_gb,
                                          tiling_max_group_gb=args.tiling_max_group_gb,
                                          reduce_bucket_mb=args.reduce_bucket_mb,
                                          state_dtype=args.state_dtype, grouping=args.grouping,
                                          grad_spill=args.grad_spill,
                                          activation_model=args.activations,
                                          **{("frozen_double_quant" if k == "double_quant" else k): v
                                             for k, v in _lora_args(args).items()}))
    return spec, machine, knobs


def run_plan(args):
    """`infinity estimate --plan`: the fastest configuration that fits (infinity.estimate.planner)."""
    from infinity.config import ConfigError
    from infinity.estimate import EstimateError
    from infinity.estimate.machine import machine_lines
    from infinity.estimate.planner import make_plan
    from infinity.estimate.report import binding_limit

    if args.only or args.activation_offload or args.prefetch_depth is not None or \
            args.grad_accum_dtype or args.explain:
        raise CLIError("--plan searches the homes, activation offload, prefetch depth and "
                       "accumulation dtype itself: drop --only/--activation-offload/"
                       "--prefetch-depth/--grad-accum-dtype/--explain")
    try:
        spec, machine, knobs = plan_inputs(args)
        plan = make_plan(spec, machine, knobs, global_batch=args.global_batch,
                         micro_batch=args.batch, grad_accum=args.grad_accum,
                         allow_lossy=args.allow_lossy, nvme_headroom=args.nvme_headroom,
                         host_headroom=args.host_headroom, nvme_derate=args.nvme_derate,
                         clip=0.0 if args.no_clip else 1.0, drive_tbw=args.drive_tbw)
    except (EstimateError, ConfigError) as e:
        raise CLIError(str(e)) from e
    limit = None
    if plan.best is None and plan.closest is not None:
        c = plan.closest
        limit = binding_limit(c.estimate.totals, c.variant, plan.machine, c.knobs)
    given = plan.assumptions.get("machine", plan.machine)
    if args.json:
        d = {"machine": given.as_dict(), "planned_machine": plan.machine.as_dict(),
             **plan.as_dict()}
        if limit is not None:
            d["closest"]["binding_limit"] = limit
        print(json.dumps(d))
    else:
        print("\n".join(machine_lines(given)) + "\n")
        text = plan.text()
        if plan.best is None:
            head, _, rest = text.partition("\n")
            text = _no_fit_headline(plan, limit) + "\n" + rest
        print(text, end="")
    return 0 if plan.best is not None else NO_FIT


def _no_fit_headline(plan, limit):
    """"No plan fits ...", the binding limit of the closest plan first, then its other problems."""
    out = (f"No plan fits: nothing of {plan.searched} fits {plan.machine.ranks} rank(s) at "
           f"global batch {plan.global_batch}")
    from infinity.estimate.report import exceeded_limits

    c = plan.closest
    if c is None:
        return out
    over = exceeded_limits(c.estimate.totals, c.variant, plan.machine, c.knobs) or list(c.problems)
    return (out + f"; the closest plan is held back by {over[0]}"
            + (" (also " + "; ".join(over[1:]) + ")" if over[1:] else "")
            + f"; that plan: {c.describe()}")
