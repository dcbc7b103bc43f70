"""Allow-list of tensor dtypes a checkpoint may contain (safetensors names <-> torch).

Only these dtype strings are ever accepted from a manifest or a safetensors
header; anything else is a :class:`CheckpointError`.
"""
import torch

from .errors import CheckpointError

_PAIRS = [
    ("F64", torch.float64), ("F32", torch.float32), ("F16", torch.float16),
    ("BF16", torch.bfloat16), ("I64", torch.int64), ("I32", torch.int32),
    ("I16", torch.int16), ("I8", torch.int8), ("U8", torch.uint8), ("BOOL", torch.bool),
]
for _name, _attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"),
                     ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")):
    if hasattr(torch, _attr):
        _PAIRS.append((_name, getattr(torch, _attr)))

ST_TO_TORCH = dict(_PAIRS)
TORCH_TO_ST = {t: s for s, t in _PAIRS}


def to_st(dtype, *, what=""):
    """torch dtype -> safetensors dtype string."""
    try:
        return TORCH_TO_ST[dtype]
    except KeyError:
        raise CheckpointError(f"{what}dtype {dtype} cannot be stored in a checkpoint; "
                              f"supported: {sorted(str(d) for d in TORCH_TO_ST)}") from None


def to_torch(name, *, where=""):
    """safetensors dtype string (from untrusted input) -> torch dtype."""
    if not isinstance(name, str) or name not in ST_TO_TORCH:
        raise CheckpointError(f"{where}unknown dtype {name!r}; allowed: {sorted(ST_TO_TORCH)}")
    return ST_TO_TORCH[name]


def itemsize(dtype):
    return torch.empty((), dtype=dtype).element_size()
