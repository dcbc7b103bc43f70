"""The infinity config `infinity finetune` runs with.

Precedence, lowest first:

1. the library defaults (DESIGN §3.5, applied by ``InfinityConfig``);
2. finetune defaults (:data:`FINETUNE_DEFAULTS`: params and optimizer homed on
   NVMe under ``./infinity-swap``, a learning rate that trains the shipped
   model, gradient clipping);
3. the ``aio`` block of a saved ``infinity bench-io --sweep --save`` result,
   when one is found (:func:`find_bench_io_result`);
4. the file given with ``--config`` (JSON or YAML);
5. command-line flags (``--nvme-path``, ``--lr``, ``--state-dtype``, ``--frozen-dtype``).
"""
import copy
import json
import logging
import os

log = logging.getLogger("infinity.finetune")

FINETUNE_DEFAULTS = {
    "precision": "fp32",
    "offload": {"params": "nvme", "optimizer": "nvme", "nvme_paths": ["./infinity-swap"]},
    "optimizer": {"type": "adamw", "lr": 3e-3, "weight_decay": 0.0},
    "gradient_clipping": 1.0,
}

# Where `infinity bench-io --sweep --save` results are looked for, in order:
# $INFINITY_BENCH_IO, then <nvme path>/bench-io.json for each swap path.
BENCH_IO_ENV = "INFINITY_BENCH_IO"
BENCH_IO_FILE = "bench-io.json"


class SettingsError(ValueError):
    pass


def deep_merge(base, over):
    """``over`` merged into a copy of ``base`` (dicts recursively, everything else replaced)."""
    out = copy.deepcopy(base)
    for k, v in (over or {}).items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def read_config_file(path):
    """The raw mapping in a JSON/YAML config file (validation happens later)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise SettingsError(f"cannot read --config {path}: {e.strerror or e}") from e
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml

            data = yaml.safe_load(text)
        else:
            data = json.loads(text)
    except Exception as e:  # json/yaml parse errors
        raise SettingsError(f"--config {path} is not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"--config {path} must hold a mapping, got {type(data).__name__}")
    return data


def find_bench_io_result(nvme_paths):
    """(path, aio dict) of a saved bench-io sweep result, or (None, None).

    The file is JSON with an ``"aio"`` object holding the best
    ``engine/block_size/queue_depth/threads`` found by the sweep (keys other
    than those four are ignored). Unreadable files are skipped with a warning.
    """
    candidates = []
    env = os.environ.get(BENCH_IO_ENV)
    if env:
        candidates.append(env)
    candidates += [os.path.join(p, BENCH_IO_FILE) for p in nvme_paths]
    for path in candidates:
        if not os.path.isfile(path):
            continue
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as e:
            log.warning("ignoring bench-io result %s: %s", path, e)
            continue
        aio = data.get("aio") if isinstance(data, dict) else None
        if not isinstance(aio, dict):
            log.warning("ignoring bench-io result %s: no 'aio' object", path)
            continue
        picked = {k: aio[k] for k in ("engine", "block_size", "queue_depth", "threads") if k in aio}
        if picked:
            return path, picked
    return None, None


def build_config(*, config_path=None, nvme_paths=None, lr=None, state_dtype=None,
                 frozen_dtype=None, use_bench_io=True):
    """(config dict, notes) — the dict is validated by ``InfinityConfig.load``."""
    from infinity.config import InfinityConfig

    notes = []
    cfg = copy.deepcopy(FINETUNE_DEFAULTS)
    file_cfg = read_config_file(config_path) if config_path else {}
    paths = nvme_paths or (file_cfg.get("offload") or {}).get("nvme_paths") or cfg["offload"]["nvme_paths"]
    if isinstance(paths, str):
        paths = [paths]
    if use_bench_io:
        found, aio = find_bench_io_result(paths)
        if found:
            cfg = deep_merge(cfg, {"aio": aio})
            notes.append(f"aio settings from {found}: {aio}")
    cfg = deep_merge(cfg, file_cfg)
    if nvme_paths:
        cfg = deep_merge(cfg, {"offload": {"nvme_paths": list(nvme_paths)}})
    if lr is not None:
        cfg = deep_merge(cfg, {"optimizer": {"lr": float(lr)}})
    if state_dtype is not None:
        cfg = deep_merge(cfg, {"optimizer": {"state_dtype": state_dtype}})
    if frozen_dtype is not None:    # --frozen-dtype: the dtype only (group_size etc. kept)
        cfg = deep_merge(cfg, {"offload": {"frozen_weights": {"dtype": frozen_dtype}}})
    InfinityConfig.load(cfg)  # raises ConfigError with the offending key
    return cfg, notes
