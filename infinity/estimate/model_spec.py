"""What the estimator needs to know about a model: sizes, not weights.

A :class:`ModelSpec` comes either from dimensions (``params``, ``layers``,
``hidden`` [, ``seq``, ``batch``, ``vocab``, ``heads``]) or from an ``nn.Module``
built on the meta device (``with torch.device("meta"):``), so counting a
trillion-parameter model costs no memory.
"""
from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import sys
from dataclasses import asdict, dataclass, field

log = logging.getLogger("infinity.estimate")

#: How the engine flattens parameters into groups (one group = one I/O request, one
#: H2D copy, one all-gather). "module": every module's own parameters (recurse=False)
#: form a group, so the largest group is the largest leaf (e.g. an MLP matrix);
#: "block": one repeated block (transformer layer) per group.
GROUPINGS = ("module", "block")


class EstimateError(ValueError):
    """Bad estimator input (missing or inconsistent model or machine description)."""


@dataclass
class ModelSpec:
    params: int                    # total parameters (tied weights counted once)
    layers: int                    # repeated blocks (transformer layers)
    hidden: int                    # hidden size
    seq: int = 2048                # sequence length per sample
    batch: int = 1                 # micro-batch size per rank
    vocab: int | None = None       # vocabulary size (logits memory); None: not counted
    heads: int | None = None       # attention heads (attention-score activations)
    largest_group: dict = field(default_factory=dict)   # grouping -> numel of the largest group
    groups: dict = field(default_factory=dict)          # grouping -> number of groups
    # memory-centric tiling (infinity.runtime.tiling splits nn.Linear / nn.Embedding groups
    # of the "module" grouping): numel of the largest group it cannot split (None: every
    # large group is a tileable matrix, as in a dense transformer: a norm, 2*hidden)
    largest_untileable: int | None = None
    # the groups tiling can split ("module" grouping), as [numel, reads, count]: ``count``
    # groups of ``numel`` elements whose tiles a micro-batch reads ``reads`` times when
    # tiled (a Linear / Conv1D use: forward and again in backward, 2; an Embedding use:
    # its forward lookup only, 1; a tied embedding / LM head group: 3).  Untiled, a group
    # is read twice (forward, backward) however many modules use it.
    tileable: list = field(default_factory=list)
    source: str = "dimensions"
    # LoRA (infinity/estimate/lora.py): the projections it adapts, ``[in, out, count]`` (the
    # nn.Linear / Conv1D inside the repeated blocks; empty: a GPT block's by dimensions),
    # the elements of quantizable weights (Linear / Conv1D / Embedding; None: by
    # dimensions)
    projections: list = field(default_factory=list)
    quantizable: int | None = None
    # whether attention keeps its S x S scores for backward: True for eager attention,
    # False for fused kernels (SDPA / flash attention: Hugging Face's _attn_implementation
    # "sdpa", "flash_attention_*", "flex_attention"); None: not known (counted, the
    # conservative side)
    attention_scores: bool | None = None

    def group_numel(self, grouping: str) -> int:
        if grouping not in GROUPINGS:
            raise EstimateError(f"grouping must be one of {GROUPINGS}, got {grouping!r}")
        return int(self.largest_group[grouping])

    def fetched_numel(self, grouping: str, tile_numel: int | None) -> int:
        """Elements one fetch puts on the device: the largest group, or with tiling (tiles
        of ``tile_numel`` elements, "module" grouping) the larger of a tile and the largest
        group tiling cannot split."""
        G = self.group_numel(grouping)
        if tile_numel is None or grouping != "module":
            return G
        rest = self.largest_untileable if self.largest_untileable is not None \
            else 2 * self.hidden
        return max(min(G, int(tile_numel)), min(G, int(rest)))

    def tiled_groups(self, grouping: str, tile_numel: int | None) -> list:
        """``[numel, reads, count]`` of the groups tiling splits under a limit of
        ``tile_numel`` elements (those larger than it; "module" grouping only)."""
        if tile_numel is None or grouping != "module":
            return []
        return [list(t) for t in self.tileable if int(t[0]) > int(tile_numel)]

    def as_dict(self):
        return asdict(self)


def _positive_int(name, v, *, allow_none=False):
    if v is None and allow_none:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or v <= 0 or int(v) != v:
        raise EstimateError(f"{name} must be a positive integer, got {v!r}")
    return int(v)


def spec_from_dims(params, layers, hidden, *, seq=2048, batch=1, vocab=None, heads=None):
    """A GPT-style shape model from dimensions.

    Per block ``(params - vocab*hidden) / layers`` parameters (embedding tied, counted once);
    the largest module inside a block is an MLP matrix, ``4*hidden^2`` parameters
    (``hidden x 4*hidden``), capped by the block itself; the embedding (``vocab*hidden``) is
    one group on its own.
    """
    params = _positive_int("params", params)
    layers = _positive_int("layers", layers)
    hidden = _positive_int("hidden", hidden)
    seq = _positive_int("seq", seq)
    batch = _positive_int("batch", batch)
    vocab = _positive_int("vocab", vocab, allow_none=True)
    heads = _positive_int("heads", heads, allow_none=True)
    emb = vocab * hidden if vocab else 0
    if emb >= params:
        raise EstimateError(f"vocab*hidden = {emb:,} is not smaller than params = {params:,}; "
                            "check --params/--vocab/--hidden")
    per_block = (params - emb) // layers
    leaf = min(per_block, 4 * hidden * hidden + 4 * hidden)
    # tileable: the block's matrices (QKV, output, two MLP: Linear uses) and the tied
    # embedding / LM head (an Embedding and a Linear use)
    tileable = [] if leaf < 4 * hidden * hidden + 4 * hidden else [
        [4 * hidden * hidden + 4 * hidden, 2, 2 * layers],
        [3 * hidden * hidden + 3 * hidden, 2, layers], [hidden * hidden + hidden, 2, layers]]
    if emb:
        tileable.append([emb, 3, 1])
    return ModelSpec(params=params, layers=layers, hidden=hidden, seq=seq, batch=batch, vocab=vocab,
                     heads=heads, tileable=tileable,
                     projections=[[hidden, 3 * hidden, layers], [hidden, hidden, layers],
                                  [hidden, 4 * hidden, layers], [4 * hidden, hidden, layers]],
                     largest_group={"module": max(leaf, emb), "block": max(per_block, emb)},
                     groups={"module": layers * 6 + (2 if emb else 1), "block": layers + 1},
                     source="dimensions")


def _config_attr(cfg, *names):
    for n in names:
        v = getattr(cfg, n, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _is_conv1d(mod) -> bool:
    """GPT-2's ``transformers.pytorch_utils.Conv1D`` (weight stored ``(in, out)``), told by
    its class (transformers is not imported for it)."""
    return any(c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils"
               for c in type(mod).__mro__)


def _tile_reads(mod, nn) -> int:
    """How many times a micro-batch reads the tiles of ``mod``'s weight when tiled (0: not
    tileable), kept in step with infinity.runtime.tiling's ``_tileable`` and runner (the
    estimator does not import the runtime): a Linear / Conv1D reads them in forward and
    again in backward, an Embedding only for its forward lookup."""
    if isinstance(mod, nn.Linear):
        return 2 if type(mod).forward is nn.Linear.forward else 0
    if isinstance(mod, nn.Embedding):
        return 1 if (type(mod).forward is nn.Embedding.forward and mod.max_norm is None
                     and not mod.sparse and not mod.scale_grad_by_freq) else 0
    if _is_conv1d(mod):
        w = getattr(mod, "weight", None)
        return 2 if w is not None and w.dim() == 2 and \
            type(mod).forward is _conv1d_forward(type(mod)) else 0
    return 0


def _conv1d_forward(cls):
    for c in cls.__mro__:
        if c.__name__ == "Conv1D" and c.__module__ == "transformers.pytorch_utils":
            return c.forward
    return None


def _tileable(mod, nn) -> bool:
    return _tile_reads(mod, nn) > 0


def spec_from_module(model, *, seq=2048, batch=1, layers=None, hidden=None, vocab=None, heads=None):
    """Count a (meta-device) ``nn.Module``: unique parameters, repeated blocks, group sizes.

    ``layers``: the longest ``nn.ModuleList``/``nn.Sequential`` of identical-typed children
    holding parameters; ``hidden``/``vocab``/``heads`` from ``model.config`` (Hugging Face
    names) or the largest ``nn.Embedding``. Explicit arguments override what is found.
    """
    import torch.nn as nn

    seen = {}                      # param id -> the module whose group holds it
    total = 0
    largest_module = largest_untileable = 0
    n_module_groups = 0
    owned = {}                     # owner module id -> numel of its group
    users = {}                     # owner module id -> the modules using its group
    for mod in model.modules():
        own = 0
        for p in mod.parameters(recurse=False):
            if id(p) in seen:
                users.setdefault(seen[id(p)], {})[id(mod)] = mod
                continue
            seen[id(p)] = id(mod)
            own += p.numel()
        if own:
            n_module_groups += 1
            owned[id(mod)] = own
            users.setdefault(id(mod), {})[id(mod)] = mod
            largest_module = max(largest_module, own)
            total += own
    # a group tiling can split: every module using it is tileable (a tied pair too)
    tileable = {}
    for oid, n in owned.items():
        reads = [_tile_reads(m, nn) for m in users[oid].values()]
        if all(reads):
            key = (n, sum(reads))
            tileable[key] = tileable.get(key, 0) + 1
        else:
            largest_untileable = max(largest_untileable, n)
    if total == 0:
        raise EstimateError(f"model {type(model).__name__} has no parameters")

    best = None
    for mod in model.modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > 1:
            kids = list(mod)
            if len({type(k) for k in kids}) == 1 and any(True for _ in kids[0].parameters()):
                if best is None or len(kids) > len(best):
                    best = kids
    # LoRA (infinity/estimate/lora.py): the projections inside the blocks, the quantizable
    # weights (infinity.memory.frozen_quant.quantizable_weights' kinds), counted once
    proj = {}
    for k in best or []:
        for m in k.modules():
            w = getattr(m, "weight", None)
            if isinstance(m, nn.Linear):
                key = (m.in_features, m.out_features)
            elif _is_conv1d(m) and w is not None and w.dim() == 2:
                key = (int(w.shape[0]), int(w.shape[1]))    # Conv1D stores (in, out)
            else:
                continue
            proj[key] = proj.get(key, 0) + 1
    qids = {}
    for m in model.modules():
        w = getattr(m, "weight", None)
        if (isinstance(m, (nn.Linear, nn.Embedding)) or _is_conv1d(m)) and \
                isinstance(w, nn.Parameter) and w.is_floating_point():
            qids[id(w)] = w.numel()
    if best is not None:
        block_sizes = [sum(p.numel() for p in k.parameters()) for k in best]
        n_layers, largest_block = len(best), max(block_sizes)
        in_blocks = sum(block_sizes)
    else:
        n_layers, largest_block, in_blocks = 1, total, total
    # parameters outside the blocks (embeddings, final norm, head) form their own groups
    outside = [m for m in model.modules() if not any(True for _ in m.children())]
    largest_outside = 0
    if best is not None:
        block_ids = {id(m) for k in best for m in k.modules()}
        for m in outside:
            if id(m) not in block_ids:
                largest_outside = max(largest_outside,
                                      sum(p.numel() for p in m.parameters(recurse=False)))
    largest_block = max(largest_block, largest_outside)

    cfg = getattr(model, "config", None)
    emb = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    big_emb = max(emb, key=lambda m: m.num_embeddings, default=None)
    if hidden is None:
        hidden = _config_attr(cfg, "hidden_size", "n_embd", "d_model", "dim") if cfg is not None else None
        if hidden is None and big_emb is not None:
            hidden = big_emb.embedding_dim
    if vocab is None:
        vocab = _config_attr(cfg, "vocab_size") if cfg is not None else None
        if vocab is None and big_emb is not None:
            vocab = big_emb.num_embeddings
    if heads is None and cfg is not None:
        heads = _config_attr(cfg, "num_attention_heads", "n_head", "num_heads")
    scores = attention_keeps_scores(cfg)
    if hidden is None:
        raise EstimateError(f"cannot tell the hidden size of {type(model).__name__}: "
                            "no config.hidden_size/n_embd and no nn.Embedding; pass --hidden")
    if layers is not None:
        n_layers = _positive_int("layers", layers)
    return ModelSpec(params=int(total), layers=int(n_layers), hidden=int(hidden),
                     seq=_positive_int("seq", seq), batch=_positive_int("batch", batch),
                     vocab=vocab, heads=heads,
                     largest_group={"module": int(largest_module), "block": int(largest_block)},
                     largest_untileable=int(largest_untileable),
                     tileable=[[n, r, c] for (n, r), c in sorted(tileable.items())],
                     groups={"module": n_module_groups,
                             "block": n_layers + (1 if total > in_blocks else 0)},
                     projections=[[i, o, c] for (i, o), c in sorted(proj.items())],
                     quantizable=int(sum(qids.values())), attention_scores=scores,
                     source=f"module {type(model).__name__}")


#: Hugging Face attention implementations that never hold the S x S scores
FUSED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3", "flex_attention",
                   "paged_attention")


def attention_keeps_scores(cfg) -> bool | None:
    """Whether a Hugging Face config's attention stores its scores for backward: False
    for fused kernels (:data:`FUSED_ATTENTION`), True for ``"eager"``, None when the
    config does not say."""
    impl = getattr(cfg, "_attn_implementation", None) if cfg is not None else None
    if not isinstance(impl, str):
        return None
    if impl == "eager":
        return True
    return False if impl.split("|")[-1] in FUSED_ATTENTION or impl.startswith("flash") \
        else None


def load_factory(path):
    """Resolve ``"package.module:function"`` or ``"path/to/file.py:function"``."""
    if not isinstance(path, str) or ":" not in path:
        raise EstimateError(f"model factory must look like 'package.module:function' or "
                            f"'path/to/file.py:function', got {path!r}")
    modname, _, fname = path.rpartition(":")
    try:
        if modname.endswith(".py") or os.sep in modname:
            if not os.path.isfile(modname):
                raise EstimateError(f"model factory file {modname!r} does not exist")
            name = "_infinity_factory_" + os.path.splitext(os.path.basename(modname))[0]
            spec = importlib.util.spec_from_file_location(name, modname)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(modname)
    except ImportError as e:
        raise EstimateError(f"cannot import the model factory module {modname!r}: {e}; "
                            "is it on PYTHONPATH?") from e
    fn = getattr(mod, fname, None)
    if not callable(fn):
        raise EstimateError(f"{modname!r} has no callable {fname!r}")
    return fn


def spec_from_factory(factory, *, seq=2048, batch=1, **overrides):
    """Build the model from ``factory`` (callable or import path) on the meta device and count it."""
    import torch

    fn = load_factory(factory) if isinstance(factory, str) else factory
    with torch.device("meta"):
        model = fn()
    import torch.nn as nn
    if not isinstance(model, nn.Module):
        raise EstimateError(f"model factory {factory!r} returned {type(model).__name__}, "
                            "expected an nn.Module")
    spec = spec_from_module(model, seq=seq, batch=batch, **overrides)
    spec.source = f"factory {factory if isinstance(factory, str) else getattr(fn, '__name__', fn)}"
    return spec
