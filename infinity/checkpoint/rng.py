"""RNG states of torch, numpy, python ``random`` (and CUDA when present) as JSON.

Stored in a checkpoint's ``meta`` so a resumed run draws the same random numbers.
Only plain lists/ints/floats/strings are produced and accepted (never pickles).
"""
import random

import torch

from .errors import CheckpointError

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None


def rng_state_to_json():
    """A JSON-safe dict with every RNG state this process uses."""
    st = {"torch": torch.get_rng_state().tolist()}
    v, internal, gauss = random.getstate()
    st["python"] = [v, list(internal), gauss]
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        st["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    if torch.cuda.is_available():
        st["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return st


def parse_rng_state(state):
    """Validate what :func:`rng_state_to_json` produced, changing nothing; returns a
    function that applies it. Every value is tried on a scratch generator first, so a
    bad state is refused before any RNG (or anything else) was touched."""
    if not isinstance(state, dict):
        raise CheckpointError(f"rng state must be a JSON object, got {type(state).__name__}")

    def _bytes(lst, what):
        if not isinstance(lst, list) or not all(type(b) is int and 0 <= b < 256 for b in lst):
            raise CheckpointError(f"rng state {what!r} must be a list of bytes")
        return torch.tensor(lst, dtype=torch.uint8)

    steps = []
    try:
        if "torch" in state:
            t = _bytes(state["torch"], "torch")
            torch.Generator().set_state(t)             # validates size and content
            steps.append(lambda t=t: torch.set_rng_state(t))
        if "python" in state:
            v, internal, gauss = state["python"]
            py = (int(v), tuple(int(x) for x in internal), gauss)
            random.Random().setstate(py)
            steps.append(lambda py=py: random.setstate(py))
        if "numpy" in state and np is not None:
            kind, keys, pos, has_gauss, cached = state["numpy"]
            ns = (str(kind), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
            np.random.RandomState().set_state(ns)
            steps.append(lambda ns=ns: np.random.set_state(ns))
        if "cuda" in state and torch.cuda.is_available():
            cs = state["cuda"]
            if not isinstance(cs, list):
                raise CheckpointError("rng state 'cuda' must be a list")
            if len(cs) == torch.cuda.device_count():
                ts = [_bytes(s, "cuda") for s in cs]
                steps.append(lambda ts=ts: torch.cuda.set_rng_state_all(ts))
    except CheckpointError:
        raise
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise CheckpointError(f"invalid rng state in checkpoint: {e}") from e

    def apply():
        for f in steps:
            f()
    return apply


def rng_state_from_json(state):
    """Restore what :func:`rng_state_to_json` produced (validated first, see
    :func:`parse_rng_state`)."""
    parse_rng_state(state)()
