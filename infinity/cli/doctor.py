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
    p.add_argument("--path", default="./infinity-swap",
                   help="NVMe swap directory to check (default: ./infinity-swap)")
    p.add_argument("--json", action="store_true", help="print the checks as one JSON object")
    p.set_defaults(func=run)


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


def collect(path):
    return (_env_checks() + _subsystem_checks("infinity.io", path)
            + _subsystem_checks("infinity.optim"))


def run(args):
    checks = collect(os.path.expanduser(args.path))
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
