"""The engine: ``initialize()``, :class:`Engine` (forward / backward / step / stats /
close), its assembly (:mod:`.build`), the optimizer step overlapped with backward
(:mod:`.overlap`), weights out (:mod:`.weights`) and checkpoint state
(:mod:`.checkpoint_state`).  See docs/architecture.md."""
from infinity.engine.core import Engine, initialize

__all__ = ["Engine", "initialize"]
