"""`infinity doctor`: is this machine ready to offload, and what to do if not.

Collects checks from each subsystem (`infinity.io.doctor_checks`,
`infinity.optim.doctor_checks`) plus the Python/torch environment, prints one
line per check with a fix for each failure, and exits 1 if any check failed.
"""
import importlib
import json
import os
import platform
import sys


def register(sub):
    p = sub.add_parser("doctor", help="check io_uring, O_DIRECT, memory locking, SIMD and torch",
                       description="Check that this machine can run infinity well, and say how to fix what is wrong.")
    p.add_argument("--nvme-path", "--path", dest="path", default="./infinity-swap", metavar="DIR",
                   help="NVMe swap directory to check (default: ./infinity-swap; --path is an alias)")
    p.add_argument("--need", type=_size, metavar="SIZE",
                   help="swap space the run needs, e.g. 20GB or 500MB (default: what `infinity "
                        "finetune` with its defaults needs)")
    p.add_argument("--json", action="store_true", help="print the checks as one JSON object")
    p.set_defaults(func=run)


def _size(s):
    import argparse
    v = s.strip().upper().replace(" ", "")
    for suffix, mul in (("TB", 10**12), ("GB", 10**9), ("G", 10**9), ("MB", 10**6), ("M", 10**6),
                        ("KB", 10**3), ("K", 10**3), ("B", 1), ("", 1)):
        if suffix and not v.endswith(suffix):
            continue
        try:
            n = float(v[: len(v) - len(suffix)] if suffix else v)
        except ValueError:
            break
        if n >= 0:
            return int(n * mul)
        break
    raise argparse.ArgumentTypeError(f"not a size: {s!r} (write e.g. 20GB, 500MB)")


def finetune_default_need():
    """NVMe bytes `infinity finetune` needs with no flags (its shipped model, params and
    optimizer on NVMe): the whole plan, as ``infinity.Init`` checks it."""
    from infinity.finetune.model import (DEFAULT_MODEL, load_model_config, plan_nvme_need,
                                         shipped_model_config)
    from infinity.finetune.settings import FINETUNE_DEFAULTS
    parts = plan_nvme_need(load_model_config(shipped_model_config(DEFAULT_MODEL)), FINETUNE_DEFAULTS)
    return sum(parts.values())


def _env_checks():
    checks = [{"name": "python", "ok": sys.version_info >= (3, 10),
               "detail": f"{platform.python_implementation()} {platform.python_version()}",
               "fix": "use Python 3.10 or newer"}]
    try:
        import torch
        cuda = torch.cuda.is_available()
        detail = f"torch {torch.__version__}; CUDA " + (
            f"available ({torch.cuda.device_count()} device(s), CUDA {torch.version.cuda})" if cuda
            else "not available: the device tier is simulated in host memory")
        checks.append({"name": "torch", "ok": True, "detail": detail, "fix": ""})
    except Exception as e:  # torch broken: report, don't crash
        checks.append({"name": "torch", "ok": False, "detail": f"cannot import torch: {e}",
                       "fix": "run `bash scripts/setup.sh` (installs torch==2.13.0 CPU in .venv)"})
    return checks


def _subsystem_checks(module, *args):
    try:
        mod = importlib.import_module(module)
        fn = getattr(mod, "doctor_checks")
    except Exception as e:
        return [{"name": module, "ok": False, "detail": f"cannot load {module}: {e}",
                 "fix": "rebuild the extensions: `bash scripts/setup.sh`"}]
    try:
        return list(fn(*args))
    except Exception as e:
        return [{"name": module, "ok": False, "detail": f"check failed: {type(e).__name__}: {e}",
                 "fix": "report this as a bug with the output of `infinity doctor --json`"}]


def collect(path, need=None, need_what=""):
    return (_env_checks() + _subsystem_checks("infinity.io", path, need, need_what)
            + _subsystem_checks("infinity.optim"))


def run(args):
    need, what = args.need, "--need"
    if need is None:
        try:
            need, what = finetune_default_need(), "by `infinity finetune` with its defaults; --need SIZE for yours"
        except Exception as e:  # a broken install is reported by the checks below
            need, what = None, f"unknown: {e}"
    checks = collect(os.path.expanduser(args.path), need, what)
    failed = [c for c in checks if not c.get("ok")]
    if args.json:
        print(json.dumps({"ok": not failed, "checks": checks}))
    else:
        width = max(len(c["name"]) for c in checks)
        for c in checks:
            mark = "ok  " if c.get("ok") else "FAIL"
            print(f"[{mark}] {c['name']:<{width}}  {c.get('detail', '')}")
            if not c.get("ok") and c.get("fix"):
                print(f"       {'':<{width}}  fix: {c['fix']}")
        print(f"\n{len(checks) - len(failed)} ok, {len(failed)} to fix")
    return 1 if failed else 0
