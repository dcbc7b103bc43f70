"""``infinity finetune --output DIR``: the fine-tuned model as a Hugging Face directory.

Written at the end of the run (and on a clean Ctrl-C/SIGTERM stop) with
``engine.save_pretrained`` (weights streamed one tensor at a time, ``config.json``,
``generation_config.json``) plus the tokenizer's files, so both
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it as is. The byte-level tokenizer is written as a ``tokenizers`` ``tokenizer.json``
(see :meth:`infinity.data.ByteTokenizer.save_pretrained`).

With ``--lora`` the directory holds the adapters as PEFT saves them
(``adapter_model.safetensors`` + ``adapter_config.json``, read from the engine's current
weights: ``peft.PeftModel.from_pretrained(base, DIR)`` loads them) and the tokenizer. The
adapter config names the base (``base_model_name_or_path``): the ``--model`` directory
when the base was loaded from one, else ``DIR/base/``, which then holds the base the
adapters were trained over (a randomly initialised one exists nowhere else; a quantized
one is written dequantized, as trained), so ``AutoPeftModelForCausalLM.from_pretrained(DIR)``
(and, with peft installed, ``AutoModelForCausalLM.from_pretrained(DIR)``) load base and
adapters in one call.

The directory is assembled as a temporary sibling and renamed into place, so ``DIR``
is either the previous contents or the complete new model, never half of one.
"""
import json
import logging
import os
import shutil

from infinity.checkpoint.export import public_file_modes
from infinity.fsmode import makedirs

log = logging.getLogger("infinity.finetune")


class OutputError(RuntimeError):
    pass


def check_output_dir(path):
    """Fail before training when ``--output`` cannot be written (not after 30 steps)."""
    path = os.path.abspath(os.fspath(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise OutputError(f"--output {path} exists and is not a directory")
    parent = os.path.dirname(path)
    probe = parent
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.access(probe, os.W_OK | os.X_OK):
        raise OutputError(f"--output {path}: {probe} is not writable; choose another directory")
    if os.path.isdir(path) and os.listdir(path) and not _looks_like_model(path):
        raise OutputError(f"--output {path} is a non-empty directory that does not hold a model "
                          "written by infinity (no config.json or adapter_config.json); choose "
                          "a new or empty directory")
    return path


def _looks_like_model(path):
    return any(os.path.exists(os.path.join(path, f))
               for f in ("config.json", "adapter_config.json"))


def _fix_config(directory, architecture=None):
    """Training runs with ``use_cache=False``; the model handed back generates with it on
    (and names its class, as ``model.save_pretrained`` would)."""
    path = os.path.join(directory, "config.json")
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        cfg = json.load(f)
    if cfg.get("use_cache") is False or (architecture and not cfg.get("architectures")):
        cfg["use_cache"] = True
        if architecture and not cfg.get("architectures"):
            cfg["architectures"] = [architecture]
        with open(path, "w", encoding="utf-8") as f:
            json.dump(cfg, f, indent=2, sort_keys=True)
            f.write("\n")


def write_output(engine, directory, tokenizer, *, rank=0, world_size=1, lora=False,
                 base_dir=None):
    """Write the model + tokenizer to ``directory`` (collective at world size > 1: every
    rank gathers, rank 0 writes). Returns the final path. ``lora``: the engine trains a PEFT
    model: write its adapters (PEFT's files) instead, naming ``base_dir`` (the ``--model``
    directory) as their base, or, without one, writing the base into ``directory/base``."""
    directory = os.path.abspath(os.fspath(directory))
    tmp = f"{directory}.tmp-infinity"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        makedirs(tmp)
    try:
        if lora:
            _write_adapters(engine, tmp, directory, tokenizer, rank=rank, base_dir=base_dir)
        else:
            engine.save_pretrained(tmp)
        if rank == 0:
            if not lora:
                module = getattr(engine, "module", None)
                _fix_config(tmp, type(module).__name__ if module is not None else None)
            tokenizer.save_pretrained(tmp)
            # one mode for every file, as save_pretrained writes them (the weights and
            # config come through 0600 temp files)
            public_file_modes(tmp)
            if os.path.isdir(os.path.join(tmp, "base")):
                public_file_modes(os.path.join(tmp, "base"))
            old = None
            if os.path.isdir(directory):
                old = f"{directory}.old-infinity"
                shutil.rmtree(old, ignore_errors=True)
                os.rename(directory, old)
            os.rename(tmp, directory)
            if old:
                shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("wrote the fine-tuned model to %s", directory)
    return directory


def _write_adapters(engine, tmp, final, tokenizer, *, rank=0, base_dir=None):
    """PEFT's ``save_pretrained`` of ``engine.module`` fed the adapters' current values
    from ``engine.state_dict()`` (their homes: the module's own tensors are placeholders
    while the engine holds them), and the base when there is no ``base_dir``."""
    from infinity.finetune.lora import adapter_names

    model = engine.module
    sd = engine.state_dict()
    adapters = {n: sd[n] for n in adapter_names(model)}    # collective at world size > 1
    base_path = os.path.abspath(base_dir) if base_dir else os.path.join(final, "base")
    if not base_dir:
        _write_base(engine, os.path.join(tmp, "base"), tokenizer, writer=rank == 0)
    if rank != 0:
        return
    for cfg in model.peft_config.values():
        cfg.base_model_name_or_path = base_path
    model.save_pretrained(tmp, state_dict=adapters, save_embedding_layers=False,
                          is_main_process=True)


def _write_base(engine, directory, tokenizer, *, writer=True, max_shard_bytes=2 * 10 ** 9):
    """The base model under the adapters as a Hugging Face directory (its own parameter
    names, streamed one tensor at a time from the engine: a quantized base dequantized),
    with ``config.json``, ``generation_config.json`` and the tokenizer."""
    from infinity.checkpoint.hf_shards import Entry, write_hf_shards
    from infinity.finetune.lora import base_model_of, base_name

    model = engine.module
    orig = getattr(engine, "orig_dtypes", {}) or {}
    sd = engine.state_dict()
    seen, sources, keys = set(), [], {}
    for name, p in model.named_parameters(remove_duplicate=False):
        out = base_name(name)
        if out is None or id(p) in seen:        # adapters; tied weights once (first name)
            continue
        seen.add(id(p))
        keys[out] = name
        sources.append((out, [Entry(out, orig.get(id(p), p.dtype), tuple(p.shape))]))
    for mname, mod in model.named_modules():
        for bname, b in mod._buffers.items():
            if b is None or bname in mod._non_persistent_buffers_set:
                continue
            full = f"{mname}.{bname}" if mname else bname
            out = base_name(full)
            if out is None or out in keys:
                continue
            keys[out] = full
            sources.append((out, [Entry(out, b.dtype, tuple(b.shape))]))
    if writer:
        makedirs(directory)
    # every rank reads every tensor in the same order (gathers at world size > 1)
    write_hf_shards(directory, sources, lambda n: {n: sd[keys[n]]},
                    max_shard_bytes=max_shard_bytes, write=writer)
    if not writer:
        return
    base = base_model_of(model)
    cfg = getattr(base, "config", None)
    if cfg is not None and hasattr(cfg, "save_pretrained"):
        cfg.save_pretrained(directory)
        gen = getattr(base, "generation_config", None)
        if gen is not None and hasattr(gen, "save_pretrained"):
            try:
                gen.save_pretrained(directory)
            except Exception as e:  # generation config is optional metadata
                log.debug("base generation_config not written: %s", e)
        _fix_config(directory, type(base).__name__)
    tokenizer.save_pretrained(directory)
