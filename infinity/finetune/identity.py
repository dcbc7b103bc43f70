"""Which *run* a checkpoint directory belongs to: resume by default, refuse another run.

A run is identified by

- the model: a shipped model by name; a config ``.json`` by path and the sha256 of the file;
  a Hugging Face directory by path and the sha256 of its weights' index file
  (``*.safetensors.index.json`` / ``*.bin.index.json``) or, without one, of the weight
  files' names, sizes and modification times (hashing gigabytes of weights would take
  longer than a step);
- the data: the shipped corpus by name; a file or directory by path, size and modification
  time (a directory: its ``.txt``/``.jsonl`` files' total size and newest time), plus the
  seed (the data order) and the tokenizer;
- the training keys of the config: optimizer (type, lr, betas, ...), schedule, precision,
  gradient clipping, micro-batch, accumulation and sequence length, and the sequence-length
  curriculum when there is one;
- with ``--lora``: the adapters (rank, alpha, dropout, target modules) and the frozen
  base's format (``offload.frozen_weights``, ``--frozen-dtype``) when it is quantized.

``--steps`` is not part of it: a larger value extends the run. :func:`run_identity`
builds the dict that every checkpoint's meta records under ``"run"``; :func:`differences`
names what changed between two of them.
"""
import hashlib
import json
import os

META_KEY = "run"
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
INDEX_SUFFIXES = (".safetensors.index.json", ".bin.index.json")
DATA_SUFFIXES = (".txt", ".jsonl", ".txt.gz", ".jsonl.gz")


def _sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def model_identity(spec):
    from infinity.finetune.model import DEFAULT_MODEL, SHIPPED_MODELS

    spec = spec or DEFAULT_MODEL
    if spec in SHIPPED_MODELS:
        return {"name": spec}
    path = os.path.abspath(spec)
    if os.path.isfile(path):
        return {"path": path, "config_sha256": _sha256_file(path)}
    if not os.path.isdir(path):
        return {"path": path}
    names = sorted(os.listdir(path))
    indexes = [n for n in names if n.endswith(INDEX_SUFFIXES)]
    if indexes:
        h = hashlib.sha256()
        for n in indexes:
            h.update(n.encode() + b"\0" + _sha256_file(os.path.join(path, n)).encode() + b"\0")
        return {"path": path, "weights_index_sha256": h.hexdigest()}
    h = hashlib.sha256()
    for n in names:
        if n.endswith(WEIGHT_SUFFIXES):
            st = os.stat(os.path.join(path, n))
            h.update(f"{n}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return {"path": path, "weights_sha256": h.hexdigest()}


def data_identity(path):
    if path is None:
        return {"name": "shipped corpus"}
    path = os.path.abspath(os.fspath(path))
    if os.path.isfile(path):
        st = os.stat(path)
        return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    if os.path.isdir(path):
        size, newest, count = 0, 0, 0
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for n in sorted(names):
                if n.startswith(".") or not n.endswith(DATA_SUFFIXES):
                    continue
                st = os.stat(os.path.join(root, n))
                size += st.st_size
                newest = max(newest, st.st_mtime_ns)
                count += 1
        return {"path": path, "files": count, "size": size, "mtime_ns": newest}
    return {"path": path}


def training_identity(cfg, *, micro_batch, grad_accum, seq_len, auto=False):
    """``auto``: ``--auto`` chose the micro-batch x accumulation split for this machine as it
    is now (it may choose another one next time), so only their product is recorded."""
    from infinity.config import InfinityConfig

    full = InfinityConfig.load(cfg).to_dict()   # defaults filled in: equal configs compare equal
    out = {"optimizer": full["optimizer"], "scheduler": full["scheduler"],
           "precision": full["precision"], "gradient_clipping": full["gradient_clipping"],
           "seq_len": int(seq_len)}
    if "curriculum_learning" in full:           # left out of to_dict() while it is the default
        out["curriculum_learning"] = full["curriculum_learning"]
    if auto:
        out["sequences_per_step"] = int(micro_batch) * int(grad_accum)
    else:
        out.update(micro_batch=int(micro_batch), gradient_accumulation_steps=int(grad_accum))
    return out


def run_identity(opts, cfg, *, micro_batch, grad_accum, seq_len, tokenizer, lora=None):
    """The JSON-able identity of this run (stored in each checkpoint's meta under ``"run"``).
    ``lora``: the run's :class:`infinity.finetune.lora.LoraSpec` (full fine-tuning: None, and
    the identity is what it was before LoRA existed)."""
    ident = {"model": model_identity(opts.model), "data": data_identity(opts.data),
             "seed": int(opts.seed), "tokenizer": tokenizer,
             "training": training_identity(cfg, micro_batch=micro_batch, grad_accum=grad_accum,
                                           seq_len=seq_len, auto=bool(opts.auto))}
    if lora is not None:
        ident["lora"] = lora.identity()
        from infinity.config import InfinityConfig

        fw = InfinityConfig.load(cfg).to_dict()["offload"].get("frozen_weights")
        if fw and fw.get("dtype"):
            ident["frozen_weights"] = fw
    return json.loads(json.dumps(ident))  # exactly what a round trip through the meta gives


def _flatten(d, prefix=""):
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        if not d and prefix:
            out[prefix[:-1]] = {}
    else:
        out[prefix[:-1]] = d
    return out


def _fmt(v):
    if v is None:
        return "unset"
    if isinstance(v, str):
        return v
    return json.dumps(v)


# Friendlier names for the keys a user changes with a flag
_LABELS = {"training.optimizer.lr": "learning rate (--lr / optimizer.lr)",
           "training.optimizer.state_dtype": "optimizer.state_dtype (--state-dtype)",
           "training.seq_len": "sequence length (--seq-len)",
           "training.micro_batch": "micro-batch (--batch-tokens / --seq-len)",
           "seed": "seed (--seed)", "tokenizer.kind": "tokenizer (--tokenizer)",
           "lora.rank": "LoRA rank (--lora)", "lora.alpha": "LoRA alpha (--lora-alpha)",
           "lora.dropout": "LoRA dropout (--lora-dropout)",
           "lora.targets": "LoRA target modules (--lora-targets)",
           "frozen_weights.dtype": "frozen base format (--frozen-dtype / "
                                   "offload.frozen_weights.dtype)"}


def differences(saved, current):
    """``["<what>: <saved> in the checkpoints, <current> now", ...]``; [] when the same run.
    A model or data source that changed kind (shipped vs path) or path is one line."""
    out = []
    for part, flag in (("model", "--model"), ("data", "--data")):
        a, b = (saved or {}).get(part) or {}, (current or {}).get(part) or {}
        if a == b:
            continue
        name_a = a.get("name") or a.get("path")
        name_b = b.get("name") or b.get("path")
        if name_a != name_b:
            out.append(f"{part} ({flag}): {_fmt(name_a)} in the checkpoints, {_fmt(name_b)} now")
        else:
            changed = sorted(k for k in set(a) | set(b) if a.get(k) != b.get(k))
            out.append(f"{part} ({flag}) {name_b} changed since the checkpoints were written "
                       f"({', '.join(changed)} differ)")
    fa = _flatten({k: v for k, v in (saved or {}).items() if k not in ("model", "data")})
    fb = _flatten({k: v for k, v in (current or {}).items() if k not in ("model", "data")})
    for key in sorted(set(fa) | set(fb)):
        if fa.get(key) != fb.get(key):
            label = _LABELS.get(key, key.removeprefix("training."))
            out.append(f"{label}: {_fmt(fa.get(key))} in the checkpoints, {_fmt(fb.get(key))} now")
    return out
