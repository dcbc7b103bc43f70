"""Build or load the causal LM that `infinity finetune` trains.

``--model`` may be
- a shipped name (``tiny-llama``, ``tiny-gpt2``: configs in ``infinity/data``),
  built with random weights;
- a config ``.json`` file (Hugging Face format), built with random weights;
- a local Hugging Face directory (``config.json`` + ``model.safetensors`` or a
  sharded ``model.safetensors.index.json``), streamed tensor by tensor:
  * params homed off the device (``offload.params`` cpu/nvme): the model is
    built under ``infinity.Init`` (each module's parameters leave for their
    home as soon as it is constructed) and every checkpoint tensor is written
    straight to its home by ``infinity.zero.init.load_safetensors`` — the
    model never exists whole in host memory;
  * otherwise: parameters start on the ``meta`` device and each is allocated
    when its tensor arrives (``safetensors.safe_open``): peak host memory is
    the model once plus the largest tensor, never two copies.

No network access: hub names are rejected with a clear error.
"""
import contextlib
import json
import logging
import os
from importlib import resources

import torch
from torch import nn

from infinity.memory.sources import record_source

log = logging.getLogger("infinity.finetune")

SHIPPED_MODELS = ("tiny-llama", "tiny-gpt2")
DEFAULT_MODEL = "tiny-llama"


class ModelError(ValueError):
    """The requested model cannot be built or loaded."""


def shipped_model_config(name):
    return str(resources.files("infinity.data").joinpath(f"{name}.json"))


def load_model_config(path):
    """A ``transformers`` config object from a Hugging Face ``config.json``."""
    from transformers import AutoConfig

    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except OSError as e:
        raise ModelError(f"cannot read model config {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ModelError(f"model config {path} is not valid JSON: {e}") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ModelError(f"model config {path} has no 'model_type' (expected a Hugging Face config.json)")
    raw = dict(raw)
    model_type = raw.pop("model_type")
    for k in ("transformers_version", "_name_or_path"):
        raw.pop(k, None)
    try:
        return AutoConfig.for_model(model_type, **raw)
    except (ValueError, KeyError) as e:
        raise ModelError(f"model config {path}: unsupported model_type {model_type!r} ({e})") from e


def build_model(config):
    """A randomly initialised causal LM from a config object (fp32, on CPU)."""
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_config(config)
    except ValueError as e:
        raise ModelError(f"cannot build a causal LM from config ({config.model_type}): {e}") from e
    model.config.use_cache = False
    return model


@contextlib.contextmanager
def parameters_on_meta():
    """While active, every parameter a module registers is moved to ``meta``
    (buffers stay real: rotary tables, masks). Construction then costs no
    parameter memory beyond one layer's transient init."""
    original = nn.Module.register_parameter

    def register_parameter(module, name, param):
        if param is not None and param.device.type != "meta":
            param = nn.Parameter(param.detach().to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register_parameter
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _safetensors_files(model_dir):
    index = os.path.join(model_dir, "model.safetensors.index.json")
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise ModelError(f"cannot read shard index {index}: {e}") from e
        files = sorted(set(weight_map.values()))
        return [os.path.join(model_dir, fn) for fn in files]
    if os.path.exists(single):
        return [single]
    found = sorted(fn for fn in os.listdir(model_dir) if fn.endswith(".safetensors"))
    if found:
        return [os.path.join(model_dir, fn) for fn in found]
    bins = [fn for fn in os.listdir(model_dir) if fn.endswith((".bin", ".pt", ".pth"))]
    hint = (f" (found {', '.join(bins)}: pickled weights are never loaded; convert them to "
            "safetensors first)") if bins else ""
    raise ModelError(f"no *.safetensors weights in {model_dir}{hint}; to train from scratch "
                     f"pass the config file itself: --model {os.path.join(model_dir, 'config.json')}")


def _name_resolver(model):
    """Map a checkpoint key to the owning (module, attr) slots of the model,
    tolerating checkpoints saved from the base model (no ``transformer.``/
    ``model.`` prefix) or with one extra."""
    slots = {}
    for mod_name, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                full = f"{mod_name}.{pname}" if mod_name else pname
                slots[full] = (mod, pname)
    from infinity.zero.init import prefix_resolver
    return slots, prefix_resolver(slots, getattr(model, "base_model_prefix", "") or "")


def _uses_init(init_config):
    """Build under ``infinity.Init`` when the parameters' home is off the device."""
    if init_config is None:
        return False
    from infinity.config import InfinityConfig

    return InfinityConfig.load(init_config).offload.params in ("cpu", "nvme")


def plan_nvme_need(config, init_config):
    """NVMe bytes per rank the whole plan needs (``infinity.zero.init.nvme_need`` over the
    model built on the ``meta`` device: nothing allocated, nothing written)."""
    import torch.distributed as dist

    from infinity.zero.init import nvme_need

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    with torch.device("meta"):
        meta = build_model(config)
    return nvme_need(meta, init_config, world_size=world)


def _build_under_init(config, init_config, *, skip_init: bool = False):
    """``skip_init``: every parameter is loaded next; the modules' own initialisation is
    skipped (``infinity.Init(skip_init=True)``)."""
    from infinity.zero.init import Init

    with Init(init_config, nvme_need=plan_nvme_need(config, init_config), skip_init=skip_init):
        return build_model(config)


def _load_into_init_model(model, files, model_dir):
    """Stream ``files`` into an Init-built model with ``infinity.zero.init.load_safetensors``
    (each tensor goes to its offloaded home). Checkpoints saved from the base model (keys
    without ``transformer.``/``model.``) are loaded into that submodule; parameters outside
    it must be tied to parameters inside (GPT-2's ``lm_head``)."""
    from safetensors import safe_open

    from infinity.zero.init import load_safetensors

    keys = []
    for fp in files:
        try:
            with safe_open(fp, framework="pt", device="cpu") as f:
                keys += list(f.keys())
        except Exception as e:  # safetensors raises its own error types
            raise ModelError(f"cannot open weights {fp}: {e}") from e
    names = dict(model.named_parameters(remove_duplicate=False))
    prefix = getattr(model, "base_model_prefix", "") or ""
    target = model
    exact = sum(k in names for k in keys)
    if prefix and hasattr(model, prefix) and sum(f"{prefix}.{k}" in names for k in keys) > exact:
        target = getattr(model, prefix)
    try:
        unexpected = load_safetensors(target, files, strict=True)
    except ValueError as e:
        raise ModelError(f"weights in {model_dir} do not fit the model built from its "
                         f"config.json: {e}") from e
    if target is not model:
        inside = {id(p) for p in target.parameters()}
        outside = [n for n, p in names.items() if id(p) not in inside]
        if outside:
            raise ModelError(f"weights in {model_dir} hold only the base model ({prefix}); "
                             f"{', '.join(outside[:5])} are missing")
    if unexpected:
        log.debug("ignored %d checkpoint tensors not in the model, e.g. %s",
                  len(unexpected), ", ".join(unexpected[:5]))
    return len(keys) - len(unexpected)


def load_pretrained(model_dir, *, init_config=None):
    """Load a local Hugging Face causal LM, streaming safetensors tensor by tensor.

    With ``init_config`` whose ``offload.params`` is ``cpu``/``nvme`` the model is built
    under ``infinity.Init(init_config)`` and each tensor is written straight to its
    offloaded home (never the whole model in memory); otherwise parameters start on
    ``meta`` and are allocated one by one as their tensor arrives.
    """
    from safetensors import safe_open

    cfg_path = os.path.join(model_dir, "config.json")
    if not os.path.exists(cfg_path):
        raise ModelError(f"{model_dir} has no config.json (expected a Hugging Face model directory)")
    config = load_model_config(cfg_path)
    files = _safetensors_files(model_dir)
    if _uses_init(init_config):
        model = _build_under_init(config, init_config, skip_init=True)
        n = _load_into_init_model(model, files, model_dir)
        model.config.use_cache = False
        log.info("loaded %s from %s into infinity.Init homes (%d tensors streamed from %d file(s))",
                 config.model_type, model_dir, n, len(files))
        return model
    with parameters_on_meta():
        model = build_model(config)
    slots, resolve = _name_resolver(model)

    # One new tensor per distinct meta parameter, shared by all its slots (tied weights).
    by_param = {}
    for full, (mod, pname) in slots.items():
        by_param.setdefault(id(mod._parameters[pname]), []).append(full)
    filled = {}  # id(meta param) -> new Parameter
    unexpected = []
    for fp in files:
        try:
            handle = safe_open(fp, framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types
            raise ModelError(f"cannot open weights {fp}: {e}") from e
        with handle as f:
            for key in f.keys():
                name = resolve(key)
                if name is None:
                    unexpected.append(key)
                    continue
                mod, pname = slots[name]
                old = mod._parameters[pname]
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != tuple(old.shape):
                    raise ModelError(f"{fp}: tensor {key} has shape {tuple(tensor.shape)} but the "
                                     f"model built from config.json expects {tuple(old.shape)} for {name}")
                if not (tensor.is_floating_point() or tensor.is_complex()):
                    raise ModelError(f"{fp}: tensor {key} has non-float dtype {tensor.dtype}")
                new = filled.get(id(old))
                if new is None:
                    new = nn.Parameter(torch.empty(old.shape, dtype=torch.float32),
                                       requires_grad=old.requires_grad)
                    filled[id(old)] = new
                with torch.no_grad():
                    new.copy_(tensor)
                del tensor
                record_source(new, fp, key)      # Note [Base by reference]
                for alias in by_param[id(old)]:
                    amod, apname = slots[alias]
                    amod._parameters[apname] = new
    missing = [names[0] for pid, names in by_param.items() if pid not in filled]
    if missing:
        raise ModelError(f"weights in {model_dir} lack {len(missing)} parameter(s) of the "
                         f"{config.model_type} model, e.g. {', '.join(missing[:5])}")
    if unexpected:
        log.debug("ignored %d checkpoint tensors not in the model, e.g. %s",
                  len(unexpected), ", ".join(unexpected[:5]))
    model.config.use_cache = False
    log.info("loaded %s from %s (%d tensors streamed from %d file(s))",
             config.model_type, model_dir, len(filled), len(files))
    return model


def resolve_model(spec=None, *, init_config=None):
    """``--model`` value -> (model, description). See the module docstring.
    ``init_config``: the infinity config; when it homes params off the device the model
    is built under ``infinity.Init`` (parameters go to their home module by module)."""
    spec = spec or DEFAULT_MODEL
    use_init = _uses_init(init_config)
    how = ", built under infinity.Init" if use_init else ""

    def build(config):
        return _build_under_init(config, init_config) if use_init else build_model(config)

    if spec in SHIPPED_MODELS:
        return build(load_model_config(shipped_model_config(spec))), f"{spec} (shipped, random init{how})"
    if os.path.isdir(spec):
        return load_pretrained(spec, init_config=init_config), f"{spec} (pretrained{how})"
    if os.path.isfile(spec):
        if not spec.endswith(".json"):
            raise ModelError(f"--model {spec}: expected a Hugging Face directory or a config .json file")
        return build(load_model_config(spec)), f"{spec} (config, random init{how})"
    raise ModelError(f"--model {spec!r} is neither a shipped model ({', '.join(SHIPPED_MODELS)}) nor "
                     "a local file/directory; downloads are not supported, save the model with "
                     "save_pretrained(dir, safe_serialization=True) and pass the directory")


def check_vocab(model, tokenizer):
    """The tokenizer's ids must fit the model's embedding."""
    emb = model.get_input_embeddings()
    n = emb.num_embeddings if emb is not None else getattr(model.config, "vocab_size", 0)
    if n < tokenizer.vocab_size:
        raise ModelError(f"the model's vocabulary has {n} entries but the tokenizer needs "
                         f"{tokenizer.vocab_size}; use a model with vocab_size >= {tokenizer.vocab_size}")
