"""``infinity finetune --lora R``: LoRA adapters (PEFT) over a frozen base, which the engine
can keep quantized at its home (``--frozen-dtype``, ``offload.frozen_weights.dtype``).

- :func:`resolve_targets` checks ``--lora-targets`` against the model (built on the
  ``meta`` device: nothing allocated) before anything is built, or derives the default:
  every ``nn.Linear`` / GPT-2 ``Conv1D`` except the LM head (the output embedding), as
  PEFT's ``"all-linear"``, written as the modules' own names (``q_proj``, ``c_attn``, ...);
- :func:`apply_lora` wraps the built base with ``peft.get_peft_model`` (``fan_in_fan_out``
  for ``Conv1D``); only the adapters train;
- :func:`adapter_names` names the adapter parameters whose values the engine hands back
  (``--output`` writes them as PEFT does: :func:`infinity.finetune.output.write_output`).
"""
import logging
from dataclasses import dataclass, field

from torch import nn

from infinity.config_sections import FROZEN_WEIGHT_DTYPES as FROZEN_DTYPES
from infinity.memory.frozen_quant import is_conv1d

log = logging.getLogger("infinity.finetune")

PEFT_REQUIREMENT = "peft>=0.15"


class LoraError(ValueError):
    """A LoRA flag that does not fit the model (or peft is missing)."""


@dataclass
class LoraSpec:
    """The LoRA settings of a run, resolved against its model."""
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: list = field(default_factory=list)   # module-name suffixes, as PEFT's target_modules
    default_targets: bool = True                  # derived from the model (no --lora-targets)
    conv1d: bool = False                          # some target is a GPT-2 Conv1D: fan_in_fan_out

    def identity(self):
        """What a checkpoint records of it (a resumed run must use the same adapters)."""
        return {"rank": int(self.rank), "alpha": float(self.alpha),
                "dropout": float(self.dropout), "targets": list(self.targets)}

    def describe(self):
        return (f"LoRA rank {self.rank}, alpha {self.alpha:g}, dropout {self.dropout:g}, on "
                f"{', '.join(self.targets)}"
                + (" (default: every Linear but the LM head)" if self.default_targets else ""))


def import_peft():
    """The ``peft`` module, or a :class:`LoraError` saying how to install it."""
    try:
        import peft
    except ImportError as e:
        raise LoraError(f"--lora needs the peft package ({PEFT_REQUIREMENT}), which is not "
                        f"installed ({e}); install it with: pip install '{PEFT_REQUIREMENT}' "
                        "(it is a dependency of infinity-offload: `pip install -e .` or "
                        "scripts/setup.sh installs it)") from e
    return peft


def is_linear(mod):
    """A layer LoRA targets here: ``nn.Linear`` or GPT-2's ``Conv1D``."""
    return isinstance(mod, nn.Linear) or is_conv1d(mod)


def _matches(name, target):
    """PEFT's rule for a list of target_modules: the name, or a suffix after a dot."""
    return name == target or name.endswith("." + target)


def _head_names(model):
    """The module name(s) of the LM head (the output embedding), left out by default."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None:
        return set()
    return {n for n, m in model.named_modules(remove_duplicate=False) if m is head}


def default_targets(model):
    """Every ``nn.Linear`` / ``Conv1D`` of ``model`` except its LM head (PEFT's
    ``"all-linear"``), as the modules' last names (``q_proj``, ``c_attn``, ...) in model
    order; a last name the LM head shares is given as full module names instead, so the
    head stays out."""
    heads = _head_names(model)
    linears = [n for n, m in model.named_modules() if is_linear(m) and n not in heads]
    head_leaves = {h.rsplit(".", 1)[-1] for h in heads}
    out = []
    for n in linears:
        leaf = n.rsplit(".", 1)[-1]
        t = n if leaf in head_leaves else leaf
        if t not in out:
            out.append(t)
    return out


def linear_leaf_names(model):
    """The distinct last names of the model's Linear/Conv1D layers, in model order."""
    out = []
    for n, m in model.named_modules():
        if is_linear(m):
            leaf = n.rsplit(".", 1)[-1]
            if leaf not in out:
                out.append(leaf)
    return out


def resolve_targets(model, targets=None):
    """``(targets, default?, any Conv1D?)`` for ``--lora-targets`` (None: the default).
    Raises :class:`LoraError` naming the model's Linear layers when a target matches no
    module, or matches modules that are not Linear/Conv1D."""
    heads = _head_names(model)
    leaves = linear_leaf_names(model)
    head_txt = f" except the LM head {', '.join(sorted(heads))}" if heads else ""
    choices = (f"the model's Linear/Conv1D layers are named {', '.join(leaves) or '(none)'} "
               f"(the default targets all of them{head_txt})")
    if isinstance(targets, str):
        targets = [targets]
    default = not targets
    if default:
        targets = default_targets(model)
        if not targets:
            raise LoraError(f"--lora: the model has no nn.Linear / Conv1D layer outside its LM "
                            f"head to put adapters on; {choices}")
    modules = dict(model.named_modules())
    conv1d = False
    seen = []
    for t in targets:
        if not isinstance(t, str) or not t.strip() or t != t.strip():
            raise LoraError(f"--lora-targets: {t!r} is not a module name; {choices}")
        if t in seen:
            continue
        seen.append(t)
        hit = [n for n in modules if n and _matches(n, t)]
        if not hit:
            raise LoraError(f"--lora-targets {t} matches no module of the model; {choices}")
        bad = [n for n in hit if not is_linear(modules[n])]
        if bad:
            kinds = sorted({type(modules[n]).__name__ for n in bad})
            raise LoraError(f"--lora-targets {t} matches {', '.join(kinds)} module(s) "
                            f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}), which "
                            f"LoRA here does not adapt; {choices}")
        conv1d = conv1d or any(is_conv1d(modules[n]) for n in hit)
    return seen, default, conv1d


def make_spec(model, *, rank, alpha=None, dropout=0.0, targets=None):
    """The :class:`LoraSpec` of ``--lora rank`` for ``model`` (any device, ``meta`` too)."""
    check_values(rank, alpha, dropout)
    targets, default, conv1d = resolve_targets(model, targets)
    return LoraSpec(rank=int(rank), alpha=float(2 * rank if alpha is None else alpha),
                    dropout=float(dropout or 0.0), targets=targets, default_targets=default,
                    conv1d=conv1d)


def check_values(rank, alpha=None, dropout=0.0):
    """The numbers of the LoRA flags (no model needed)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise LoraError(f"--lora must be a LoRA rank >= 1, got {rank!r}")
    if alpha is not None and not (isinstance(alpha, (int, float)) and alpha > 0
                                  and alpha != float("inf")):
        raise LoraError(f"--lora-alpha must be a number > 0, got {alpha!r}")
    if dropout is not None and not (isinstance(dropout, (int, float)) and 0.0 <= dropout < 1.0):
        raise LoraError(f"--lora-dropout must be in [0, 1), got {dropout!r}")


def apply_lora(model, spec):
    """``peft.get_peft_model(model, LoraConfig(...))``: the base frozen, adapters trainable.
    Works on a model built under ``infinity.Init`` (PEFT reads only the layers' shapes)."""
    import warnings

    peft = import_peft()
    cfg = peft.LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
                          target_modules=list(spec.targets), fan_in_fan_out=spec.conv1d,
                          bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():
        # fan_in_fan_out is per layer kind (True for Conv1D, False for Linear): PEFT
        # corrects it per layer and says so
        warnings.filterwarnings("ignore", message=".*fan_in_fan_out.*")
        # PEFT asks the model through transformers' old name (transformers 5 warns)
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                category=FutureWarning)
        return peft.get_peft_model(model, cfg)


def adapter_names(model):
    """Names of the trainable (adapter) parameters of a PEFT model, in order."""
    return [n for n, p in model.named_parameters() if p.requires_grad]


def param_counts(model):
    """(trainable, total) parameters, tied ones counted once."""
    seen, trainable, total = set(), 0, 0
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        total += p.numel()
        if p.requires_grad:
            trainable += p.numel()
    return trainable, total


def base_model_of(model):
    """The Hugging Face model under a PEFT wrapper (the model itself otherwise)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def base_name(name):
    """A PEFT parameter name as the base model names it (``None`` for an adapter):
    ``base_model.model.X.base_layer.weight`` -> ``X.weight``."""
    from infinity.checkpoint import lora_merge
    return None if lora_merge.has_adapters([name]) else lora_merge.base_name(name)


def frozen_format(engine):
    """``{"dtype", "home_bytes", "bytes"}`` of the frozen groups the engine keeps quantized
    (``None`` when it keeps none)."""
    grouping = getattr(engine, "grouping", None)
    groups = getattr(grouping, "groups", None) or []
    q = [g for g in groups if getattr(g, "quant", None) is not None]
    if not q:
        return None
    fw = engine.cfg.offload.frozen_weights
    return {"dtype": fw.dtype, "group_size": fw.group_size, "double_quant": fw.double_quant,
            "home_bytes": sum(g.home_nbytes for g in q), "bytes": sum(g.nbytes for g in q),
            "groups": len(q)}
