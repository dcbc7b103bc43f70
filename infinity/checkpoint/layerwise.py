"""A Hugging Face causal LM run one decoder block at a time, its weights read from a
tensor source (a checkpoint) on demand: what layer-by-layer distillation and
self-generated calibration need without the model ever being whole in memory.

The *shell* is the model built on the CPU from its own config with one decoder block:
embeddings, final norm, LM head, rotary tables and that one block. Block ``i`` is run by
loading its weights into the shell's block (``load_block``). The inputs a block sees
(hidden states and the keyword arguments the model passes its blocks: position
embeddings, masks, ...) are captured once by running the shell up to its block.
Nothing here is specific to one architecture: the block list is the ``nn.ModuleList``
whose length is the config's number of layers.
"""
from __future__ import annotations

import copy
import logging
import re

import torch
from torch import nn

from .errors import CheckpointError

log = logging.getLogger("infinity.checkpoint")


class _Stop(Exception):
    pass


def hf_config(model_config: dict):
    from transformers import AutoConfig
    d = dict(model_config)
    mt = d.pop("model_type", None)
    if not mt:
        raise CheckpointError("the checkpoint's model config has no model_type")
    for k in ("quantization_config", "_name_or_path"):
        d.pop(k, None)
    return AutoConfig.for_model(mt, **d)


def meta_model(model_config: dict) -> nn.Module:
    """The model on the meta device (no memory): names, module types, shapes."""
    from transformers import AutoModelForCausalLM
    cfg = hf_config(model_config)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg)


def is_conv1d(m: nn.Module) -> bool:
    """GPT-2-style ``transformers.pytorch_utils.Conv1D`` (weight stored ``(in, out)``)."""
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:          # pragma: no cover - transformers is what builds these models
        return False
    return isinstance(m, Conv1D)


def linear_modules(model: nn.Module):
    """``(module name, rows, cols, is_output_embedding, is_conv1d)`` of every ``nn.Linear``
    (rows x cols = out x in) and ``Conv1D`` (in x out: its weight as stored)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    out = []
    for n, m in model.named_modules():
        if isinstance(m, nn.Linear):
            out.append((n, m.out_features, m.in_features, m is head, False))
        elif is_conv1d(m) and getattr(m, "weight", None) is not None and m.weight.dim() == 2:
            rows, cols = m.weight.shape
            out.append((n, int(rows), int(cols), m is head, True))
    return out


def block_list(model: nn.Module, n_layers: int) -> str:
    """Dotted name of the ``nn.ModuleList`` holding the ``n_layers`` decoder blocks."""
    best = None
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers and n_layers > 0:
            size = sum(p.numel() for p in m.parameters())
            if best is None or size > best[1]:
                best = (name, size)
    if best is None:
        raise CheckpointError(f"cannot find the {n_layers} decoder blocks of "
                              f"{type(model).__name__} (no nn.ModuleList of that length)")
    return best[0]


class LayerwiseModel:
    """See the module doc. ``get(name)`` returns checkpoint tensor ``name``; ``names`` are
    the checkpoint's model tensor names."""

    def __init__(self, model_config: dict, get, names, *, dtype=torch.float32):
        from transformers import AutoModelForCausalLM
        self.get = get
        self.dtype = dtype
        cfg = hf_config(model_config)
        self.n_layers = int(cfg.num_hidden_layers)
        skeleton = meta_model(model_config)
        self.prefix = block_list(skeleton, self.n_layers) + "."
        del skeleton
        one = copy.deepcopy(cfg)
        one.num_hidden_layers = 1
        if isinstance(getattr(one, "layer_types", None), list):
            one.layer_types = one.layer_types[:1]
        one.use_cache = False
        self.shell = AutoModelForCausalLM.from_config(one, dtype=dtype).eval()
        self.block = dict(self.shell.named_modules())[self.prefix + "0"]
        pat = re.compile(re.escape(self.prefix) + r"(\d+)\.(.+)")
        self.block_names: list[dict[str, str]] = [dict() for _ in range(self.n_layers)]
        outer = {}
        for n in names:
            m = pat.fullmatch(n)
            if m:
                i = int(m.group(1))
                if i >= self.n_layers:
                    raise CheckpointError(f"{n}: block {i} but the config has {self.n_layers} layers")
                self.block_names[i][m.group(2)] = n
            else:
                outer[n] = n
        sd = self.shell.state_dict()
        shell_outer = {k for k in sd if not k.startswith(self.prefix)}
        missing = [k for k in shell_outer if k not in outer]
        tied = getattr(cfg, "tie_word_embeddings", False)
        with torch.no_grad():
            for k in shell_outer:
                if k in outer:
                    sd[k].copy_(get(k))
        head = self.shell.get_output_embeddings()
        head_keys = {k for k, p in self.shell.named_parameters(remove_duplicate=False)
                     if head is not None and p is head.weight}
        missing = [k for k in missing if not (tied and k in head_keys)]
        if missing:
            raise CheckpointError(f"the checkpoint lacks tensors the model needs: {missing[:10]}")
        self.loaded = None

    def load_block(self, i: int, overrides=None) -> nn.Module:
        """The shell's block holding block ``i``'s weights (``overrides``: local name ->
        tensor, used instead of the checkpoint's)."""
        want = self.block_names[i]
        sd = self.block.state_dict()
        missing = [k for k in sd if k not in want]
        if missing:
            raise CheckpointError(f"block {i}: the checkpoint lacks {[self.prefix + str(i) + '.' + k for k in missing][:10]}")
        with torch.no_grad():
            for k, t in sd.items():
                src = overrides[k] if overrides and k in overrides else self.get(want[k])
                t.copy_(src)
        self.loaded = i
        return self.block

    @torch.no_grad()
    def block_inputs(self, ids: torch.Tensor):
        """(hidden states entering block 0, the keyword arguments blocks receive)."""
        caught = {}

        def hook(_mod, args, kwargs):
            caught["args"], caught["kwargs"] = args, kwargs
            raise _Stop

        h = self.block.register_forward_pre_hook(hook, with_kwargs=True)
        try:
            self.shell(input_ids=ids, use_cache=False)
        except _Stop:
            pass
        finally:
            h.remove()
        if "args" not in caught:
            raise CheckpointError("the model's forward never reached its decoder block")
        args, kwargs = caught["args"], dict(caught["kwargs"])
        hidden = args[0] if args else kwargs.pop("hidden_states")
        return hidden, {k: v for k, v in kwargs.items() if k != "hidden_states"}

    def run_block(self, block: nn.Module, hidden, kwargs):
        out = block(hidden, **kwargs)
        return out[0] if isinstance(out, (tuple, list)) else out

    @torch.no_grad()
    def logits(self, ids):
        """The full model's logits for ``ids``, streaming every block once: the shell runs
        again with its block's output replaced by the last block's, so its own final norm
        and head finish the job, whatever they are."""
        hidden, kw = self.block_inputs(ids)
        for i in range(self.n_layers):
            hidden = self.run_block(self.load_block(i), hidden, kw)

        def replace(_mod, _args, out):
            return (hidden, *out[1:]) if isinstance(out, (tuple, list)) else hidden

        h = self.block.register_forward_hook(replace)
        try:
            return self.shell(input_ids=ids, use_cache=False).logits
        finally:
            h.remove()

    @torch.no_grad()
    def generate(self, n_seqs: int, length: int, *, bos: int | None, vocab: int,
                 generator: torch.Generator, temperature: float = 1.0) -> torch.Tensor:
        """``n_seqs`` sequences of ``length`` tokens sampled from the model itself (the
        calibration data of ZeroQuant's LKD when none is given): each new token streams
        every block once."""
        start = torch.full((n_seqs, 1), bos if bos is not None else 0, dtype=torch.long)
        if bos is None:
            start = torch.randint(0, vocab, (n_seqs, 1), generator=generator)
        ids = start
        while ids.shape[1] < length:
            logits = self.logits(ids)[:, -1, :vocab].float() / temperature
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            ids = torch.cat([ids, nxt], dim=1)
        return ids
