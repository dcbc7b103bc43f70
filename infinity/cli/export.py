"""`infinity export DIR OUT [--tag T] [--quantize int8|int4 [--group-size N] [--lkd ...]]`:
consolidated safetensors model from a checkpoint, with ``config.json``/
``generation_config.json`` and the tokenizer's files when the checkpoint records them
(``infinity finetune`` checkpoints do); with ``--quantize`` the Linear weights in the
compressed-tensors format, optionally distilled layer by layer (``--lkd``). A LoRA
checkpoint (``infinity finetune --lora``) is written as its base model with the adapters
merged, or with ``--adapters-only`` as PEFT adapter files."""
import argparse
import logging
import sys

from .argtypes import positive_int

log = logging.getLogger("infinity.cli")

_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _size(s):
    try:
        v = s.strip().upper()
        for suffix, mul in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
            if v.endswith(suffix):
                return int(float(v[: -len(suffix)]) * mul)
        return int(v)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {s!r} (e.g. 5GB, 500MB, 1000000)") from None


def register(subparsers):
    p = subparsers.add_parser(
        "export", help="write a consolidated safetensors model from a checkpoint",
        description="Write the model weights of checkpoint DIR/<tag> (default: DIR/latest) to "
                    "OUT/model.safetensors, or OUT/model-XXXXX-of-YYYYY.safetensors plus "
                    "model.safetensors.index.json when larger than --max-shard-size, plus "
                    "config.json, generation_config.json and the tokenizer files when the "
                    "checkpoint records its model (infinity finetune checkpoints do), so "
                    "AutoModelForCausalLM/AutoTokenizer.from_pretrained(OUT) load it. Optimizer "
                    "states are not exported. Every checksum is verified first. A LoRA "
                    "checkpoint (infinity finetune --lora) is written as its base model with "
                    "the adapters merged (W + alpha/r * B @ A), under the base model's own "
                    "names, 16-bit or --quantize'd like any model; --adapters-only writes the "
                    "adapters as PEFT does instead.")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (the one holding 'latest')")
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one in DIR/latest)")
    p.add_argument("--max-shard-size", type=_size, default=5 * 10**9,
                   help="largest output file (default 5GB; sizes in 10^n bytes)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="cast floating-point weights (default: as saved)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="do not write the tokenizer files the checkpoint records")
    p.add_argument("--adapters-only", action="store_true",
                   help="LoRA checkpoints: write the adapters as PEFT does "
                        "(adapter_model.safetensors + adapter_config.json, loaded by "
                        "peft.AutoPeftModelForCausalLM.from_pretrained(OUT)) instead of merging "
                        "them into the base; the base is the run's --model directory, or, when "
                        "the run had none, OUT/base/ written from the checkpoint")
    q = p.add_argument_group(
        "quantized export", "weight-only, symmetric, group-wise INT8/INT4 quantization of the "
        "nn.Linear layers (and GPT-2-style Conv1D layers, in their stored layout), written in "
        "the compressed-tensors format (transformers with the compressed-tensors package "
        "loads it; vLLM reads the format, not tested here); the embeddings, the LM head and "
        "every other tensor stay 16-bit (--dtype, default bf16 for an fp32 checkpoint)")
    q.add_argument("--quantize", choices=("int8", "int4"), default=None,
                   help="quantize the Linear weights")
    q.add_argument("--group-size", type=positive_int, default=128, metavar="N",
                   help="elements per scale along the input dimension (default 128); a layer "
                        "whose input size N does not divide gets one scale per output channel")
    q.add_argument("--quantize-lm-head", action="store_true",
                   help="quantize the LM head too (an untied one)")
    q.add_argument("--lkd", action="store_true",
                   help="layer-by-layer knowledge distillation: each quantized decoder block "
                        "trained to match its 16-bit output on calibration activations")
    q.add_argument("--calib-data", metavar="PATH", default=None,
                   help="calibration text (a file, a directory of .txt/.jsonl, a .jsonl with "
                        "'text'), tokenized with the checkpoint's tokenizer; default: sequences "
                        "generated by the model itself")
    q.add_argument("--calib-samples", type=positive_int, default=16, metavar="N",
                   help="calibration sequences (default 16)")
    q.add_argument("--calib-len", type=positive_int, default=128, metavar="T",
                   help="tokens per calibration sequence (default 128)")
    q.add_argument("--lkd-steps", type=positive_int, default=100, metavar="N",
                   help="optimizer steps per block (default 100)")
    q.add_argument("--lkd-mode", choices=("ste", "scale"), default="ste",
                   help="train the weights through straight-through rounding (ste, default) "
                        "or the per-group scales (scale)")
    q.add_argument("--lkd-lr", type=float, default=None, metavar="X",
                   help="learning rate (default 1e-4 for ste, 1e-3 for scale)")
    q.add_argument("--lkd-chunk-tokens", type=positive_int, default=4096, metavar="N",
                   help="calibration tokens per forward/backward of a block (whole sequences, "
                        "at least one; default 4096): the activations held at once")
    q.add_argument("--lkd-host-mb", type=int, default=1024, metavar="MB",
                   help="calibration activations kept in host memory (default 1024 MB; 0: all "
                        "on NVMe); the rest is paged to --lkd-swap")
    q.add_argument("--lkd-swap", metavar="PATH", default=None,
                   help="directory for the calibration activations beyond --lkd-host-mb "
                        "(private, unlinked swap files; default: OUT)")
    q.add_argument("--seed", type=int, default=0, help="seed of the generated calibration data")
    p.set_defaults(func=run)


def calibration_ids(meta, path, n, length):
    """``(n, length)`` token ids from the text at ``path``, tokenized with the tokenizer
    the checkpoint records (byte-level when it records none); consecutive windows, evenly
    spread over the text."""
    import torch

    from infinity.data import ByteTokenizer, DataError, HFTokenizer, load_texts
    source = meta.get("tokenizer") or {"kind": "byte"}
    if source.get("kind") == "hf":
        tok = HFTokenizer(source.get("path"))
    elif source.get("kind") == "byte":
        tok = ByteTokenizer()
    else:
        raise DataError(f"the checkpoint records an unknown tokenizer {source!r}")
    ids = torch.cat([torch.as_tensor(tok.encode_array(t), dtype=torch.long)
                     for t in load_texts(path)])
    if ids.numel() < length:
        raise DataError(f"calibration data {path} has {ids.numel()} tokens, fewer than one "
                        f"sequence of --calib-len {length}")
    windows = ids.numel() // length
    take = torch.linspace(0, windows - 1, min(n, windows)).round().long()
    return ids[: windows * length].view(windows, length)[take]


def run(args):
    import torch

    from infinity.checkpoint import CheckpointError, export_model
    from infinity.cli.main import CLIError
    meta = {}
    dtype = getattr(torch, _DTYPES[args.dtype]) if args.dtype else None
    lkd_only = [f for f, v in (("--lkd", args.lkd), ("--calib-data", args.calib_data),
                               ("--lkd-swap", args.lkd_swap)) if v]
    if args.quantize is None and lkd_only:
        raise CLIError(f"{' and '.join(lkd_only)} need --quantize int8|int4")
    if args.calib_data and not args.lkd:
        raise CLIError("--calib-data is the calibration data of --lkd; add --lkd")
    if args.adapters_only and args.quantize is not None:
        raise CLIError("--adapters-only writes the LoRA adapters unmerged; --quantize quantizes a "
                       "merged model: choose one")
    report = {}
    try:
        if args.adapters_only:
            from infinity.checkpoint.export import export_adapters
            files = export_adapters(args.dir, args.out, args.tag,
                                    max_shard_bytes=args.max_shard_size, dtype=dtype,
                                    meta_out=meta, report=report)
        elif args.quantize is None:
            files = export_model(args.dir, args.out, args.tag, max_shard_bytes=args.max_shard_size,
                                 dtype=dtype, meta_out=meta, report=report)
        else:
            files = _export_quantized(args, dtype, meta, report)
    except CheckpointError as e:
        raise CLIError(str(e)) from e
    if args.adapters_only:
        base = report["base"]
        print(f"LoRA adapters written as PEFT's files ({report['lora']}); their base: {base}"
              + (" (written from the checkpoint)" if report["base_written"] else
                 " (the run's --model directory)"), file=sys.stderr)
    elif report.get("lora"):
        print(f"LoRA checkpoint: {report['lora']}, written under the base model's names",
              file=sys.stderr)
    if "model_config" not in meta and not args.adapters_only:
        print(f"note: the checkpoint does not record its model's config, so {args.out} holds the "
              "weights only; write config.json beside them (model.config.save_pretrained(OUT)) "
              "to load it with from_pretrained", file=sys.stderr)
    source = meta.get("tokenizer")
    if source and not args.no_tokenizer:
        from infinity.data import DataError, write_tokenizer
        targets = [args.out]
        if report.get("base_written"):
            targets.append(report["base"])      # the base directory loads on its own too
        try:
            for target in targets:
                files += write_tokenizer(source, target)
        except (DataError, OSError, ValueError) as e:
            print(f"note: tokenizer not exported: {e}", file=sys.stderr)
    for f in files:
        print(f, file=sys.stdout)
    return 0


def _export_quantized(args, dtype, meta, report):
    from infinity.checkpoint import CheckpointReader
    from infinity.checkpoint.compressed import QuantOptions
    from infinity.checkpoint.lkd import LKDOptions
    from infinity.checkpoint.quantized_export import export_quantized
    from infinity.cli.main import CLIError
    from infinity.data import DataError
    opts = QuantOptions(args.quantize, group_size=args.group_size, dtype=dtype,
                        include_lm_head=args.quantize_lm_head)
    lkd = calib = None
    if args.lkd:
        if args.lkd_host_mb < 0:
            raise CLIError(f"--lkd-host-mb must be >= 0, got {args.lkd_host_mb}")
        lkd = LKDOptions(steps=args.lkd_steps, lr=args.lkd_lr, mode=args.lkd_mode,
                         chunk_tokens=args.lkd_chunk_tokens, host_bytes=args.lkd_host_mb * 10**6,
                         swap_path=args.lkd_swap)
        if args.calib_data:
            with CheckpointReader(args.dir, args.tag) as r:
                ckpt_meta = r.meta
            try:
                calib = calibration_ids(ckpt_meta, args.calib_data, args.calib_samples,
                                        args.calib_len)
            except (DataError, OSError) as e:
                raise CLIError(f"calibration data: {e}") from e
    files = export_quantized(args.dir, args.out, args.tag, options=opts,
                             max_shard_bytes=args.max_shard_size, meta_out=meta, lkd=lkd,
                             calib_ids=calib, calib_generate=(args.calib_samples, args.calib_len),
                             seed=args.seed, report=report)
    print(f"quantized export ({args.quantize}, group {args.group_size}) in "
          f"{report.get('seconds', 0):.1f} s", file=sys.stderr)
    pages = report.get("lkd_pages")
    if pages and pages["chunks_on_nvme"]:
        print(f"LKD calibration activations: {report['lkd_chunks']} chunk(s) per block, "
              f"{pages['nvme_write_bytes'] / 1e6:.1f} MB paged to NVMe, "
              f"{pages['nvme_read_bytes'] / 1e6:.1f} MB read back", file=sys.stderr)
    return files
