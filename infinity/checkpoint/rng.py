"""RNG states of torch, numpy, python ``random`` (and CUDA when present) as JSON.

Stored in a checkpoint's ``meta`` so a resumed run draws the same random numbers.
Only plain lists/ints/floats/strings are produced and accepted (never pickles).
Read back, every entry is untrusted: :func:`parse_rng_state` checks its exact layout
and refuses anything else with a :class:`CheckpointError` naming the entry.
"""
import math
import random

import torch

from .errors import CheckpointError

try:
    import numpy as np
except ImportError:  # pragma: no cover
    np = None

_MT_WORDS = 624                  # Mersenne Twister state words (python random, numpy)
_U32 = 1 << 32
# the layouts rng_state_to_json writes, quoted by the errors
_LAYOUT = {
    "torch": "a list of bytes (torch.get_rng_state())",
    "python": f"[3, [{_MT_WORDS} words in [0, 2^32) then an index in [0, {_MT_WORDS}]], "
              f"null or a finite number]",
    "numpy": f'["MT19937", [{_MT_WORDS} words in [0, 2^32)], an index in [0, {_MT_WORDS}], '
             f"0 or 1, a finite number]",
    "cuda": "a list (one per device) of lists of bytes",
}


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


def _bad(entry, why):
    return CheckpointError(f"rng state {entry!r}: {why}; expected {_LAYOUT[entry]}")


def _int_in(v, lo, hi):
    return type(v) is int and lo <= v <= hi


def _finite(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _bytes(lst, entry):
    if not isinstance(lst, list) or not all(type(b) is int and 0 <= b < 256 for b in lst):
        raise _bad(entry, "not a list of integers in [0, 255]")
    return torch.tensor(lst, dtype=torch.uint8)


def _words(lst, n, entry):
    if not isinstance(lst, list) or len(lst) != n:
        got = f"{len(lst)} entries" if isinstance(lst, list) else type(lst).__name__
        raise _bad(entry, f"the state vector must hold {n} entries, got {got}")
    for i, w in enumerate(lst[:_MT_WORDS]):
        if not _int_in(w, 0, _U32 - 1):
            raise _bad(entry, f"state word {i} is {w!r}, not an integer in [0, 2^32)")


def _record(value, n, entry):
    if not isinstance(value, list) or len(value) != n:
        got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
        raise _bad(entry, f"must be a list of {n} entries, got {got}")
    return value


def _parse_python(value):
    v, internal, gauss = _record(value, 3, "python")
    if v != 3 or type(v) is not int:
        raise _bad("python", f"version {v!r} is not 3")
    _words(internal, _MT_WORDS + 1, "python")
    if not _int_in(internal[-1], 0, _MT_WORDS):
        raise _bad("python", f"index {internal[-1]!r} is not in [0, {_MT_WORDS}]")
    if gauss is not None and not _finite(gauss):
        raise _bad("python", f"the cached gaussian {gauss!r} is not null or a finite number")
    py = (3, tuple(internal), None if gauss is None else float(gauss))
    random.Random().setstate(py)
    return lambda: random.setstate(py)


def _parse_numpy(value):
    kind, keys, pos, has_gauss, cached = _record(value, 5, "numpy")
    if kind != "MT19937":
        raise _bad("numpy", f"generator {kind!r} is not \"MT19937\"")
    _words(keys, _MT_WORDS, "numpy")
    if not _int_in(pos, 0, _MT_WORDS):
        raise _bad("numpy", f"index {pos!r} is not in [0, {_MT_WORDS}]")
    if not _int_in(has_gauss, 0, 1):
        raise _bad("numpy", f"has_gauss {has_gauss!r} is not 0 or 1")
    if not _finite(cached):
        raise _bad("numpy", f"the cached gaussian {cached!r} is not a finite number")
    ns = ("MT19937", np.asarray(keys, dtype=np.uint32), pos, has_gauss, float(cached))
    np.random.RandomState().set_state(ns)
    return lambda: np.random.set_state(ns)


def parse_rng_state(state):
    """Validate what :func:`rng_state_to_json` produced, changing nothing; returns a
    function that applies it. Every entry's layout is checked, then tried on a scratch
    generator, so a bad state is refused (:class:`CheckpointError` naming the entry)
    before any RNG (or anything else) was touched."""
    if not isinstance(state, dict):
        raise CheckpointError(f"rng state must be a JSON object, got {type(state).__name__}")
    steps = []
    try:
        if "torch" in state:
            t = _bytes(state["torch"], "torch")
            try:
                torch.Generator().set_state(t)             # validates size and content
            except RuntimeError as e:
                raise _bad("torch", f"refused by torch ({e})") from None
            steps.append(lambda t=t: torch.set_rng_state(t))
        if "python" in state:
            steps.append(_parse_python(state["python"]))
        if "numpy" in state and np is not None:
            steps.append(_parse_numpy(state["numpy"]))
        if "cuda" in state and torch.cuda.is_available():
            cs = state["cuda"]
            if not isinstance(cs, list):
                raise _bad("cuda", f"got {type(cs).__name__}")
            if len(cs) == torch.cuda.device_count():
                ts = [_bytes(s, "cuda") for s in cs]
                steps.append(lambda ts=ts: torch.cuda.set_rng_state_all(ts))
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - untrusted input: whatever a library raises
        raise CheckpointError(f"invalid rng state in checkpoint: {type(e).__name__}: {e}") from e

    def apply():
        for f in steps:
            f()
    return apply


def rng_state_from_json(state):
    """Restore what :func:`rng_state_to_json` produced (validated first, see
    :func:`parse_rng_state`)."""
    parse_rng_state(state)()
