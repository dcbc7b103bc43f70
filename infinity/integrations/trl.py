"""TRL's ``SFTTrainer`` on an infinity engine: ``InfinitySFTTrainer(...,
infinity_config=cfg)`` (:class:`~infinity.integrations.transformers.InfinityTrainerMixin`
over ``trl.SFTTrainer``).  Any other TRL trainer: ``class T(InfinityTrainerMixin,
trl.XTrainer): pass``, plus :func:`register_fused_lm_head` when it uses TRL's fused LM head
(trainers that keep a second model, e.g. a reference model, train only the first on the
engine).  See docs/trainers.md."""
from __future__ import annotations

from trl import SFTTrainer as _SFTTrainer

from infinity.integrations.transformers import InfinityTrainerMixin

__all__ = ["InfinitySFTTrainer", "register_fused_lm_head"]


def register_fused_lm_head(engine, model) -> None:
    """TRL's fused LM head (``model(..., fused_lm_head=True)``) multiplies by the output
    embedding's weight inside the *model's* forward, not the LM head module's: declare it
    as used by that forward (``engine.register_external_parameter``), so the engine fetches
    it for the whole forward instead of leaving its released placeholder there."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get = getattr(base, "get_output_embeddings", None)
    head = get() if get is not None else None
    if head is None or getattr(head, "weight", None) is None:
        return
    engine.register_external_parameter(base, head.weight)


class InfinitySFTTrainer(InfinityTrainerMixin, _SFTTrainer):
    """``trl.SFTTrainer`` on an infinity engine."""

    def _ensure_engine(self):
        fresh = self.engine is None
        eng = super()._ensure_engine()
        if fresh:
            register_fused_lm_head(eng, self.model)
        return eng
