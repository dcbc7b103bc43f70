"""``infinity finetune --output DIR``: the fine-tuned model as a Hugging Face directory.

Written at the end of the run (and on a clean Ctrl-C/SIGTERM stop) with
``engine.save_pretrained`` (weights streamed one tensor at a time, ``config.json``,
``generation_config.json``) plus the tokenizer's files, so both
``AutoModelForCausalLM.from_pretrained(DIR)`` and ``AutoTokenizer.from_pretrained(DIR)``
load it as is. The byte-level tokenizer is written as a ``tokenizers`` ``tokenizer.json``
(see :meth:`infinity.data.ByteTokenizer.save_pretrained`).

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
                          "written by infinity (no config.json); choose a new or empty directory")
    return path


def _looks_like_model(path):
    return os.path.exists(os.path.join(path, "config.json"))


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


def write_output(engine, directory, tokenizer, *, rank=0, world_size=1):
    """Write the model + tokenizer to ``directory`` (collective at world size > 1: every
    rank gathers, rank 0 writes). Returns the final path."""
    directory = os.path.abspath(os.fspath(directory))
    tmp = f"{directory}.tmp-infinity"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        makedirs(tmp)
    try:
        engine.save_pretrained(tmp)
        if rank == 0:
            module = getattr(engine, "module", None)
            _fix_config(tmp, type(module).__name__ if module is not None else None)
            tokenizer.save_pretrained(tmp)
            # one mode for every file, as save_pretrained writes them (the weights and
            # config come through 0600 temp files)
            public_file_modes(tmp)
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
