"""Export the model weights of a checkpoint as consolidated safetensors.

Output (Hugging Face layout): ``OUT/model.safetensors``, or when larger than
``max_shard_bytes`` ``OUT/model-00001-of-0000N.safetensors`` ... plus
``OUT/model.safetensors.index.json`` (``{"metadata": {"total_size"}, "weight_map"}``).
Model tensors are every checkpoint name that does not start with ``optim.``
(the optimizer-state namespace), unless ``meta["model_names"]`` lists them.
Partitioned tensors (saved by several ranks) are reassembled. Tensors stream one
at a time through the shared writer (:mod:`.hf_shards`): each output file is written
under a temp name, fsynced and renamed.

When the checkpoint's meta records the model (``meta["model_config"]``, and
``meta["generation_config"]``: see :func:`model_meta`, which ``infinity finetune``
passes to every save), ``OUT/config.json`` and ``OUT/generation_config.json`` are
written too, so ``AutoModelForCausalLM.from_pretrained(OUT)`` loads the export as is.
``meta["tokenizer"]`` says where the tokenizer came from; ``infinity export`` (the
CLI, a layer above) writes its files.

A LoRA checkpoint (``infinity finetune --lora R --save``) is exported as its base model
with the adapters merged (:mod:`.lora_merge`), or with :func:`export_adapters` as PEFT
adapter files.
"""
import json
import logging
import os

from .errors import CheckpointError
from .fsutil import atomic_write_text, check_path
from .hf_shards import INDEX_NAME, Entry, write_hf_shards
from .lora_merge import (adapter_config, lora_checkpoint, recorded_base_dir,
                         write_adapter_config, write_adapter_weights)
from .reader import CheckpointReader
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.checkpoint")

OPTIM_PREFIX = "optim."
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"


def model_meta(model, *, tokenizer=None):
    """JSON-able checkpoint meta describing ``model`` (a Hugging Face model, or anything
    with a ``config.to_dict()``): ``{"model_config": {...}, "generation_config": {...},
    "tokenizer": tokenizer}``. Pass it as ``extra_meta=`` to ``engine.save_checkpoint``;
    :func:`export_model` writes ``config.json``/``generation_config.json`` from it.
    ``tokenizer``: a JSON-able description of the tokenizer's source (``infinity
    finetune`` records ``{"kind": "byte"}`` or ``{"kind": "hf", "path": DIR}``).
    Models without a config give ``{}`` (plus the tokenizer)."""
    out = {}
    cfg = getattr(model, "config", None)
    if cfg is not None and hasattr(cfg, "to_dict"):
        d = json.loads(cfg.to_json_string(use_diff=False)) if hasattr(cfg, "to_json_string") \
            else json.loads(json.dumps(cfg.to_dict(), default=str))
        d.pop("_name_or_path", None)
        if not d.get("architectures"):
            d["architectures"] = [type(model).__name__]
        # training turns the KV cache off (use_cache=False); a model handed back generates
        if "use_cache" in d:
            d["use_cache"] = True
        out["model_config"] = d
        gen = getattr(model, "generation_config", None)
        if gen is not None and hasattr(gen, "to_dict"):
            try:
                out["generation_config"] = json.loads(json.dumps(gen.to_dict(), default=str))
            except (TypeError, ValueError) as e:
                log.debug("model_meta: generation_config not recorded: %s", e)
    if tokenizer is not None:
        out["tokenizer"] = tokenizer
    return out


def _umask() -> int:
    """The process umask, read without changing it where /proc says (else set and restored)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def public_file_modes(directory, names=None) -> None:
    """Give the files of an output directory the mode ``save_pretrained`` gives its files:
    0666 under the umask (0644 with the usual 022). ``names``: the files written (names or
    paths; default every regular file directly in ``directory``). The weights and config are
    written through 0600 temp files (atomic rename), the tokenizer by its library: without
    this one directory would hold two modes."""
    directory = os.fspath(directory)
    if names is None:
        names = os.listdir(directory)
    mode = 0o666 & ~_umask()
    for n in names:
        path = os.path.join(directory, os.fspath(n))
        try:
            if os.path.isfile(path) and not os.path.islink(path):
                os.chmod(path, mode)
        except OSError as e:      # e.g. a file someone else owns: leave it as it is
            log.debug("public_file_modes: %s left as it is: %s", path, e)


def write_model_config(meta, out_dir):
    """``config.json`` (+ ``generation_config.json``) from a checkpoint's meta; returns the
    files written ([] when the checkpoint does not record its model)."""
    written = []
    cfg = meta.get("model_config") if isinstance(meta, dict) else None
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return written
    for name, d in ((CONFIG_NAME, cfg), (GENERATION_CONFIG_NAME, meta.get("generation_config"))):
        if isinstance(d, dict) and d:
            path = os.path.join(out_dir, name)
            atomic_write_text(path, json.dumps(d, indent=2, sort_keys=True) + "\n")
            written.append(path)
    return written


def model_names(reader):
    listed = reader.meta.get("model_names")
    if listed is not None:
        if not isinstance(listed, list) or not all(isinstance(n, str) for n in listed):
            raise CheckpointError(f"{reader.path}: meta['model_names'] must be a list of strings")
        missing = [n for n in listed if n not in reader]
        if missing:
            raise CheckpointError(f"{reader.path}: meta['model_names'] lists tensors that are not "
                                  f"in the checkpoint: {missing[:20]}")
        return list(listed)
    return [n for n in reader.names() if not n.startswith(OPTIM_PREFIX)]


def export_model(ckpt_dir, out_dir, tag=None, *, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES,
                 dtype=None, verify=True, meta_out=None, report=None):
    """Write the checkpoint's model weights (and ``config.json`` +
    ``generation_config.json`` when its meta records the model) to ``out_dir``; returns
    the list of files. ``meta_out`` (a dict), when given, receives the checkpoint's meta.

    A LoRA checkpoint (``infinity finetune --lora``: ``meta["lora"]``, PEFT's tensor names)
    is written as its base model with the adapters merged (:mod:`.lora_merge`): the base
    model's own names, each adapted weight ``W + (alpha / r) B @ A`` (transposed for
    Conv1D) in the base weight's dtype or ``dtype``. ``report`` (a dict), when given,
    receives ``{"lora": "<what was merged>"}`` then."""
    if max_shard_bytes <= 0:
        raise CheckpointError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
    with CheckpointReader(ckpt_dir, tag) as r:
        if verify:
            r.verify()
        names = model_names(r)
        if not names:
            raise CheckpointError(f"{r.path} contains no model tensors to export")
        lora = lora_checkpoint(r, names)
        info = r.info
        if lora is not None:
            names, info = lora.names, lora.info
        sources = []
        for n in names:
            shape, dt = info(n)
            odt = dtype if (dtype is not None and dt.is_floating_point) else dt
            sources.append((n, [Entry(n, odt, tuple(shape))]))
        out_dir = _make_out_dir(out_dir)
        odts = dict((n, ents[0].dtype) for n, ents in sources)

        def produce(n):
            if lora is not None:
                return {n: lora.read(n, odts[n])}
            t = r.read(n)
            return {n: t.to(odts[n]) if t.dtype != odts[n] else t}

        written, total = write_hf_shards(out_dir, sources, produce,
                                         max_shard_bytes=max_shard_bytes)
        cfg_files = write_model_config(r.meta, out_dir)
        if cfg_files and dtype is not None:
            set_config_dtype(cfg_files[0], dtype)
        written += cfg_files
        public_file_modes(out_dir, written)
        if not cfg_files:
            log.warning("%s does not record its model's config: %s gets the weights only (write "
                        "config.json beside them, e.g. model.config.save_pretrained(OUT))",
                        r.path, out_dir)
        if meta_out is not None:
            meta_out.update(r.meta)
        if lora is not None:
            if report is not None:
                report["lora"] = lora.describe()
            log.info("%s: %s", r.path, lora.describe())
        log.info("exported %d tensors (%d bytes) from %s to %s", len(sources), total, r.path, out_dir)
        return written


def _make_out_dir(out_dir):
    out_dir = check_path(out_dir, "export target")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise CheckpointError(f"export target {out_dir} exists and is not a directory")
    makedirs(out_dir)
    return out_dir


def export_adapters(ckpt_dir, out_dir, tag=None, *, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES,
                    dtype=None, verify=True, meta_out=None, report=None):
    """The adapters of a LoRA checkpoint as PEFT's ``save_pretrained`` writes them:
    ``out_dir/adapter_model.safetensors`` + ``out_dir/adapter_config.json``, whose
    ``base_model_name_or_path`` names the base: the ``--model`` directory the run loaded it
    from when the meta records one that still holds a model, else ``out_dir/base/``, written
    here from the checkpoint (the base's own names, unmerged, with ``config.json``: the
    values the adapters were trained over). Returns the files written; ``report`` receives
    ``{"lora": ..., "base": path, "base_written": bool}``."""
    with CheckpointReader(ckpt_dir, tag) as r:
        if verify:
            r.verify()
        names = model_names(r)
        lora = lora_checkpoint(r, names)
        if lora is None:
            raise CheckpointError(f"{r.path} is not a LoRA checkpoint (its meta has no 'lora' "
                                  f"entry and it holds no lora_A/lora_B tensors): there are no "
                                  f"adapters to write; export the whole model without "
                                  f"--adapters-only")
        out_dir = _make_out_dir(out_dir)
        base = recorded_base_dir(r.meta)
        written, base_written = [], base is None
        if base_written:
            base = os.path.join(out_dir, "base")
        acfg = adapter_config(lora, os.path.abspath(base))    # needs peft: before any write
        cfg = r.meta.get("model_config")
        if base_written and not (isinstance(cfg, dict) and "model_type" in cfg):
            raise CheckpointError(f"{r.path} does not record its model's config "
                                  f"(meta['model_config']), so a base written beside the "
                                  f"adapters could not be loaded; export it merged instead")
        if base_written:
            makedirs(base)
            sources = []
            for n in lora.names:
                shape, dt = lora.info(n)
                odt = dtype if (dtype is not None and dt.is_floating_point) else dt
                sources.append((n, [Entry(n, odt, tuple(shape))]))
            odts = dict((n, ents[0].dtype) for n, ents in sources)
            files, _ = write_hf_shards(base, sources,
                                       lambda n: {n: lora.read_base(n, odts[n])},
                                       max_shard_bytes=max_shard_bytes)
            cfg_files = write_model_config(r.meta, base)
            if dtype is not None:
                set_config_dtype(cfg_files[0], dtype)
            public_file_modes(base, files + cfg_files)
            written += files + cfg_files
        written.append(write_adapter_weights(lora, out_dir, dtype))
        written.append(write_adapter_config(acfg, out_dir))
        public_file_modes(out_dir, written[-2:])
        if meta_out is not None:
            meta_out.update(r.meta)
        if report is not None:
            report.update(lora=lora.describe(merged=False), base=os.path.abspath(base),
                          base_written=base_written)
        log.info("wrote the LoRA adapters of %s to %s (base: %s)", r.path, out_dir, base)
        return written


def set_config_dtype(path, dtype):
    """The exported weights' dtype in config.json (``torch_dtype``/``dtype``, as recorded)."""
    with open(path, encoding="utf-8") as f:
        d = json.load(f)
    name = str(dtype).replace("torch.", "")
    for key in ("dtype", "torch_dtype"):
        if key in d:
            d[key] = name
    atomic_write_text(path, json.dumps(d, indent=2, sort_keys=True) + "\n")


def load_exported(out_dir):
    """Helper for tests/tools: read an export back as a dict of tensors (via safetensors)."""
    from safetensors import safe_open
    index = os.path.join(out_dir, INDEX_NAME)
    if os.path.exists(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for fn in files:
        with safe_open(os.path.join(out_dir, fn), framework="pt") as f:
            for k in f.keys():
                out[k] = f.get_tensor(k)
    return out

