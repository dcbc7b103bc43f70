"""Functional Adam/AdamW over flat contiguous CPU tensors, on the SIMD kernels.

``adam_step`` is what the offload engine and the NVMe optimizer pipeline call
(on whole partitions or on tiles of them, from any thread); ``CPUAdam``
(``infinity.optim.cpu_adam``) is the ``torch.optim.Optimizer`` built on it.

The kernel (``infinity._cpu_adam``, csrc/cpu_adam/) is chosen at run time from
CPUID: AVX-512, AVX2+FMA+F16C or portable scalar. ``INFINITY_SIMD=scalar|avx2|avx512``
forces one (an ISA the CPU lacks is an error). All three give bit-identical
fp32 results: they follow torch's ``_single_tensor_adam`` arithmetic without
FMA contraction.
"""
import logging
import math
import numbers
import operator
import os
import threading

import torch

log = logging.getLogger("infinity.optim")

SIMD_ENV = "INFINITY_SIMD"
SIMD_LEVELS = ("scalar", "avx2", "avx512")

_PARAM_DTYPES = (torch.float32,)
_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_STATE_DTYPES = (torch.float32, torch.bfloat16)
_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_ext = None
_ext_lock = threading.Lock()


class SimdUnavailableError(RuntimeError):
    """The SIMD level requested (INFINITY_SIMD or select_simd) cannot run on this CPU."""


def _kernel():
    """The loaded extension, with the INFINITY_SIMD override applied on first use."""
    global _ext
    if _ext is not None:
        return _ext
    with _ext_lock:
        if _ext is not None:
            return _ext
        try:
            from infinity import _cpu_adam as ext
        except ImportError as e:
            raise ImportError(
                f"infinity._cpu_adam is not built ({e}); build it with "
                "`INFINITY_BUILD_ONLY=_cpu_adam python setup.py build_ext --inplace` "
                "or `bash scripts/setup.sh`") from e
        want = os.environ.get(SIMD_ENV, "").strip().lower()
        if want:
            _apply_simd(ext, want, source=f"{SIMD_ENV}={os.environ.get(SIMD_ENV)!r}")
        _ext = ext
        log.debug("CPU Adam kernel: %s, %d thread(s)", ext.simd_level(), ext.get_num_threads())
        return ext


def _apply_simd(ext, name, source):
    if name not in SIMD_LEVELS:
        raise ValueError(f"{source}: unknown SIMD level {name!r}; expected one of {', '.join(SIMD_LEVELS)}")
    if not ext.cpu_supports(name):
        feats = ", ".join(f for f, ok in ext.cpu_features() if ok) or "none"
        raise SimdUnavailableError(
            f"{source}: this CPU cannot run the {name} Adam kernel (CPU features: {feats}); "
            f"unset {SIMD_ENV} or choose one of: "
            + ", ".join(lv for lv in SIMD_LEVELS if ext.cpu_supports(lv)))
    ext.select_simd(name)


def select_simd(name):
    """Force the kernel ISA for this process ("scalar", "avx2" or "avx512"); for tests and comparisons.

    Raises ``ValueError`` for an unknown name and ``SimdUnavailableError`` when the CPU lacks it.
    """
    if not isinstance(name, str):
        raise TypeError(f"select_simd: name must be a str, got {type(name).__name__}")
    _apply_simd(_kernel(), name.strip().lower(), source="select_simd")


def simd_level():
    """The kernel in use: "avx512", "avx2" or "scalar"."""
    return _kernel().simd_level()


def best_simd():
    """The widest kernel this CPU supports (what is used without an override)."""
    return _kernel().best_simd()


def cpu_supports(name):
    """True when this CPU can run the named kernel ("scalar", "avx2", "avx512")."""
    if name not in SIMD_LEVELS:
        raise ValueError(f"unknown SIMD level {name!r}; expected one of {', '.join(SIMD_LEVELS)}")
    return _kernel().cpu_supports(name)


def set_num_threads(n):
    """Threads used by the Adam kernels (default: the CPUs this process may run on)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"set_num_threads: n must be an int, got {n!r}")
    if n < 1:
        raise ValueError(f"set_num_threads: n must be >= 1, got {n}")
    _kernel().set_num_threads(n)


def get_num_threads():
    return _kernel().get_num_threads()


def default_num_threads():
    """``len(os.sched_getaffinity(0))``, as the kernel computes it."""
    return _kernel().default_num_threads()


# --------------------------------------------------------------------------- validation

_CODES = None


def _dtype_code(ext, dtype):
    global _CODES
    if _CODES is None:
        _CODES = {None: ext.DTYPE_NONE, torch.float32: ext.DTYPE_F32,
                  torch.bfloat16: ext.DTYPE_BF16, torch.float16: ext.DTYPE_F16}
    return _CODES[dtype]


_STRIDED = torch.strided


def _tensor_ok(t, dtypes, numel):
    """Fast path of _check_tensor: True when t passes every check (no message built)."""
    return (isinstance(t, torch.Tensor) and t.is_cpu and t.dtype in dtypes and t.layout == _STRIDED
            and t.is_contiguous() and t.numel() == numel and not t.is_neg())


def _number_ok(x, lo, hi):
    return (type(x) is float or type(x) is int) and lo <= x < hi and math.isfinite(x)


def _check_tensor(name, t, dtypes, numel):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"adam_step: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu":
        raise ValueError(f"adam_step: {name} is on {t.device}; the CPU Adam kernel needs CPU tensors")
    if t.layout != torch.strided:
        raise ValueError(f"adam_step: {name} has layout {t.layout}; only dense (strided) tensors are supported")
    if t.dtype not in dtypes:
        raise TypeError(f"adam_step: {name} has dtype {t.dtype}; expected one of "
                        + ", ".join(str(d) for d in dtypes))
    if not t.is_contiguous():
        raise ValueError(f"adam_step: {name} is not contiguous (shape {tuple(t.shape)}, strides {t.stride()}); "
                         "pass a flat contiguous tensor (e.g. .contiguous())")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"adam_step: {name} has {t.numel()} elements but param has {numel}")
    if t.is_conj() or t.is_neg():
        raise ValueError(f"adam_step: {name} has a lazy conj/neg bit set; call .resolve_conj()/.resolve_neg() first")


def _check_number(name, x, lo=None, hi=None, lo_open=False, hi_open=False):
    if isinstance(x, bool) or not isinstance(x, numbers.Real):
        if isinstance(x, torch.Tensor) and x.numel() == 1:
            x = float(x.item())
        else:
            raise TypeError(f"adam_step: {name} must be a real number, got {x!r}")
    x = float(x)
    if not math.isfinite(x):
        raise ValueError(f"adam_step: {name} must be finite, got {x!r}")
    if lo is not None and (x < lo or (lo_open and x == lo)):
        raise ValueError(f"adam_step: {name} must be {'>' if lo_open else '>='} {lo}, got {x!r}")
    if hi is not None and (x > hi or (hi_open and x == hi)):
        raise ValueError(f"adam_step: {name} must be {'<' if hi_open else '<='} {hi}, got {x!r}")
    return x


def _validate_slow(param, grad, exp_avg, exp_avg_sq, param_out, n, step, lr, beta1, beta2, eps,
                   weight_decay, grad_scale):
    _check_tensor("param", param, (torch.float32,), None)
    _check_tensor("grad", grad, _GRAD_DTYPES, n)
    _check_tensor("exp_avg", exp_avg, _STATE_DTYPES, n)
    _check_tensor("exp_avg_sq", exp_avg_sq, _STATE_DTYPES, n)
    if exp_avg.dtype != exp_avg_sq.dtype:
        raise TypeError(f"adam_step: exp_avg ({exp_avg.dtype}) and exp_avg_sq ({exp_avg_sq.dtype}) "
                        "must have the same dtype")
    if param_out is not None:
        _check_tensor("param_out", param_out, _OUT_DTYPES, n)
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = step.item()
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    if isinstance(step, bool):
        raise TypeError(f"adam_step: step must be an int (1-based), got {step!r}")
    try:
        step = operator.index(step)
    except TypeError:
        raise TypeError(f"adam_step: step must be an int (1-based), got {step!r}") from None
    if step < 1:
        raise ValueError(f"adam_step: step is 1-based (the count after this update), got {step}")
    lr = _check_number("lr", lr, lo=0.0)
    beta1 = _check_number("beta1", beta1, lo=0.0, hi=1.0, hi_open=True)
    beta2 = _check_number("beta2", beta2, lo=0.0, hi=1.0, hi_open=True)
    eps = _check_number("eps", eps, lo=0.0)
    weight_decay = _check_number("weight_decay", weight_decay, lo=0.0)
    grad_scale = _check_number("grad_scale", grad_scale)
    return step, lr, beta1, beta2, eps, weight_decay, grad_scale


def adam_step(param, grad, exp_avg, exp_avg_sq, *, step, lr, beta1, beta2, eps, weight_decay,
              adamw=True, bias_correction=True, grad_scale=1.0, param_out=None):
    """One Adam (``adamw=False``: L2 decay) or AdamW update, in place, on flat CPU tensors.

    ``param`` is the fp32 master; ``grad`` fp32, bf16 or fp16; ``exp_avg``/``exp_avg_sq``
    fp32 or bf16 (bf16 states halve their bytes at a numerics cost: each state is
    rounded to 8 mantissa bits after every update; with lr 1e-2 the params drift
    ~1.2e-4 norm-relative from the fp32-state trajectory after 20 steps, ~4e-4 after
    100; the update itself uses the unrounded values); ``param_out`` None or a
    bf16/fp16/fp32 tensor of the same numel that receives the updated params in the
    same pass (round to nearest even). ``step`` is 1-based: the count after this
    update, as in torch. The gradient is multiplied by ``grad_scale`` before anything
    else (pass ``clip_coef / loss_scale``). All tensors must be contiguous CPU tensors
    of equal numel (any shape). Releases the GIL; safe to call from any thread.

    Returns True when every result is finite as stored: False when the master, a
    moment or ``param_out`` came out inf/NaN or beyond its dtype's range (an overflow,
    e.g. an fp16 ``param_out`` above 65504, or ``exp_avg_sq`` of a gradient above ~1e19).
    The update is written either way; the engine rolls such an update back or stops
    (Note [non-finite result] in infinity/optim/step_txn.py).
    """
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"adam_step: param must be a torch.Tensor, got {type(param).__name__}")
    n = param.numel()
    fast = (_tensor_ok(param, _PARAM_DTYPES, n) and _tensor_ok(grad, _GRAD_DTYPES, n)
            and _tensor_ok(exp_avg, _STATE_DTYPES, n) and _tensor_ok(exp_avg_sq, _STATE_DTYPES, n)
            and exp_avg.dtype == exp_avg_sq.dtype
            and (param_out is None or _tensor_ok(param_out, _OUT_DTYPES, n))
            and type(step) is int and step >= 1
            and _number_ok(lr, 0.0, math.inf) and _number_ok(beta1, 0.0, 1.0) and _number_ok(beta2, 0.0, 1.0)
            and _number_ok(eps, 0.0, math.inf) and _number_ok(weight_decay, 0.0, math.inf)
            and _number_ok(grad_scale, -math.inf, math.inf))
    if not fast:  # find the offending argument and raise with its name and value
        step, lr, beta1, beta2, eps, weight_decay, grad_scale = _validate_slow(
            param, grad, exp_avg, exp_avg_sq, param_out, n, step, lr, beta1, beta2, eps, weight_decay,
            grad_scale)
    if n == 0:
        return True
    if bias_correction:
        bias_correction1 = 1 - beta1 ** step
        bias_correction2 = 1 - beta2 ** step
        step_size = lr / bias_correction1
        bc2_sqrt = bias_correction2 ** 0.5
    else:
        step_size = lr
        bc2_sqrt = 1.0
    ext = _kernel()
    return ext.adam_step(param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(),
                  0 if param_out is None else param_out.data_ptr(), n,
                  _dtype_code(ext, grad.dtype), _dtype_code(ext, exp_avg.dtype),
                  _dtype_code(ext, None if param_out is None else param_out.dtype),
                  lr, beta1, beta2, eps, weight_decay, bool(adamw), step_size, bc2_sqrt, grad_scale)


def triad(p, g, m, v, scale=1e-3):
    """Roofline reference over the bytes of an fp32 Adam step: ``x = scale*g; p += x; m += x; v += x``.

    Four fp32 reads and three fp32 writes per element, on the same threads and ISA as the
    Adam kernel. Used by ``infinity bench-adam`` to measure the memory-bandwidth ceiling.
    """
    n = p.numel()
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
        _check_tensor(name, t, (torch.float32,), n)
    _kernel().triad(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), n, float(scale))


def doctor_checks():
    """Checks for `infinity doctor`: dicts with keys name, ok, detail, fix."""
    checks = []
    try:
        from infinity import _cpu_adam as ext
    except ImportError as e:
        return [{"name": "cpu_adam", "ok": False, "detail": f"extension infinity._cpu_adam not built: {e}",
                 "fix": "run `bash scripts/setup.sh` (or `INFINITY_BUILD_ONLY=_cpu_adam python setup.py "
                        "build_ext --inplace`)"}]
    feats = dict(ext.cpu_features())
    best = ext.best_simd()
    detail = "CPU features: " + ", ".join(f"{k}={'yes' if v else 'no'}" for k, v in feats.items())
    if best == "scalar":
        detail += ("; no AVX2+FMA+F16C: the optimizer step runs on the portable scalar kernel "
                   "(correct, several times slower)")
    checks.append({"name": "cpu_simd", "ok": True, "detail": detail, "fix": ""})
    override = os.environ.get(SIMD_ENV, "").strip()
    try:
        level = simd_level()
        detail = f"{level} kernel" + (f" (forced by {SIMD_ENV}={override})" if override else f" (best available: {best})")
        ok, fix = True, ""
        if override and level != best:
            detail += f"; the CPU supports {best}"
    except (ValueError, RuntimeError) as e:
        detail, ok = str(e), False
        fix = f"unset {SIMD_ENV} or set it to a level this CPU supports"
    checks.append({"name": "cpu_adam_kernel", "ok": ok, "detail": detail, "fix": fix})
    n, dflt = ext.get_num_threads(), ext.default_num_threads()
    checks.append({"name": "cpu_adam_threads", "ok": n >= 1,
                   "detail": f"{n} thread(s) for the optimizer step ({dflt} CPU(s) in this process's affinity mask)",
                   "fix": "" if n >= 1 else "call infinity.optim.set_num_threads(n) with n >= 1"})
    return checks
