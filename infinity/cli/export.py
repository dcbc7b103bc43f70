"""`infinity export DIR OUT [--tag T]`: consolidated safetensors model from a checkpoint,
with ``config.json``/``generation_config.json`` and the tokenizer's files when the
checkpoint records them (``infinity finetune`` checkpoints do)."""
import argparse
import logging
import sys

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
                    "states are not exported. Every checksum is verified first.")
    p.add_argument("dir", metavar="DIR", help="checkpoint directory (the one holding 'latest')")
    p.add_argument("out", metavar="OUT", help="output directory (created if missing)")
    p.add_argument("--tag", default=None, help="checkpoint tag (default: the one in DIR/latest)")
    p.add_argument("--max-shard-size", type=_size, default=5 * 10**9,
                   help="largest output file (default 5GB; sizes in 10^n bytes)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None,
                   help="cast floating-point weights (default: as saved)")
    p.add_argument("--no-tokenizer", action="store_true",
                   help="do not write the tokenizer files the checkpoint records")
    p.set_defaults(func=run)


def run(args):
    import torch

    from infinity.checkpoint import CheckpointError, export_model
    from infinity.cli.main import CLIError
    meta = {}
    try:
        files = export_model(args.dir, args.out, args.tag, max_shard_bytes=args.max_shard_size,
                             dtype=getattr(torch, _DTYPES[args.dtype]) if args.dtype else None,
                             meta_out=meta)
    except CheckpointError as e:
        raise CLIError(str(e)) from e
    if "model_config" not in meta:
        print(f"note: the checkpoint does not record its model's config, so {args.out} holds the "
              "weights only; write config.json beside them (model.config.save_pretrained(OUT)) "
              "to load it with from_pretrained", file=sys.stderr)
    source = meta.get("tokenizer")
    if source and not args.no_tokenizer:
        from infinity.data import DataError, write_tokenizer
        try:
            files += write_tokenizer(source, args.out)
        except (DataError, OSError, ValueError) as e:
            print(f"note: tokenizer not exported: {e}", file=sys.stderr)
    for f in files:
        print(f, file=sys.stdout)
    return 0
