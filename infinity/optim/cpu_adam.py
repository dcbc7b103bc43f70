"""CPUAdam: a ``torch.optim.Optimizer`` running Adam/AdamW on the SIMD CPU kernels.

Drop-in for ``torch.optim.AdamW`` (``adamw=True``, the default) or
``torch.optim.Adam`` with L2 weight decay (``adamw=False``) on CPU fp32
parameters. Param groups carry per-group hyperparameters; ``state_dict`` uses
torch's layout (per-parameter ``step`` (0-dim fp32 tensor), ``exp_avg``,
``exp_avg_sq``; torch's group keys), so a state dict saved by one loads into
the other and training continues identically. LR schedulers work (they edit
``group["lr"]``, read at every step).

The decay mode of a group lives in torch's key ``decoupled_weight_decay``;
``adamw`` is kept as a mirror of it for readability. ``bias_correction=False``
is an extension torch does not have (a torch optimizer loading such a state dict
would bias-correct).
"""
import torch

from .functional import adam_step

_GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_hparams(where, lr, betas, eps, weight_decay):
    if isinstance(lr, torch.Tensor):
        if lr.numel() != 1:
            raise ValueError(f"{where}: lr tensor must have one element, got shape {tuple(lr.shape)}")
        lr = float(lr.item())
    if not 0.0 <= lr:
        raise ValueError(f"{where}: invalid learning rate {lr!r} (must be >= 0)")
    if not 0.0 <= eps:
        raise ValueError(f"{where}: invalid eps {eps!r} (must be >= 0)")
    try:
        b1, b2 = betas
    except (TypeError, ValueError):
        raise ValueError(f"{where}: betas must be a pair (beta1, beta2), got {betas!r}") from None
    if not 0.0 <= b1 < 1.0:
        raise ValueError(f"{where}: invalid beta1 {b1!r} (must be in [0, 1))")
    if not 0.0 <= b2 < 1.0:
        raise ValueError(f"{where}: invalid beta2 {b2!r} (must be in [0, 1))")
    if not 0.0 <= weight_decay:
        raise ValueError(f"{where}: invalid weight_decay {weight_decay!r} (must be >= 0)")


class CPUAdam(torch.optim.Optimizer):
    """Adam/AdamW over CPU fp32 parameters with the SIMD kernel of ``infinity.optim.adam_step``.

    Args mirror ``torch.optim.AdamW``; ``adamw=False`` gives Adam with L2 decay
    (``torch.optim.Adam``); ``bias_correction=False`` skips the bias corrections.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 adamw=True, bias_correction=True):
        _check_hparams("CPUAdam", lr, betas, eps, weight_decay)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        adamw=bool(adamw), decoupled_weight_decay=bool(adamw),
                        bias_correction=bool(bias_correction),
                        # torch.optim.Adam(W)'s keys, so our state dicts load there unchanged
                        amsgrad=False, maximize=False, foreach=None, capturable=False,
                        differentiable=False, fused=None)
        super().__init__(params, defaults)

    def add_param_group(self, param_group):
        if not isinstance(param_group, dict):
            raise TypeError(f"CPUAdam: a param group must be a dict, got {type(param_group).__name__}")
        g = dict(param_group)
        if "adamw" in g and "decoupled_weight_decay" not in g:
            g["decoupled_weight_decay"] = bool(g["adamw"])
        elif "decoupled_weight_decay" in g and "adamw" not in g:
            g["adamw"] = bool(g["decoupled_weight_decay"])
        super().add_param_group(g)
        group = self.param_groups[-1]
        where = f"CPUAdam param group {len(self.param_groups) - 1}"
        _check_hparams(where, group["lr"], group["betas"], group["eps"], group["weight_decay"])
        for i, p in enumerate(group["params"]):
            self._check_param(p, f"{where}, parameter {i}")

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            if "decoupled_weight_decay" not in group:
                group["decoupled_weight_decay"] = bool(group.get("adamw", True))
            group["adamw"] = bool(group["decoupled_weight_decay"])
            group.setdefault("bias_correction", True)
            for k, v in (("amsgrad", False), ("maximize", False), ("foreach", None),
                         ("capturable", False), ("differentiable", False), ("fused", None)):
                group.setdefault(k, v)

    @staticmethod
    def _check_param(p, where):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"{where}: expected a tensor, got {type(p).__name__}")
        if p.device.type != "cpu":
            raise ValueError(f"{where} is on {p.device}: CPUAdam updates CPU tensors only "
                             "(use torch.optim.AdamW on the device, or offload the parameters to the CPU)")
        if p.dtype != torch.float32:
            raise TypeError(f"{where} has dtype {p.dtype}: CPUAdam keeps fp32 master weights; "
                            "hold an fp32 copy and pass it, or call adam_step with param_out for a "
                            "low-precision copy")

    @torch.no_grad()
    def step(self, closure=None):
        """One update of every parameter with a gradient. Returns the closure's loss, if any."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for gi, group in enumerate(self.param_groups):
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                raise ValueError(f"CPUAdam param group {gi}: amsgrad/maximize/differentiable are not supported "
                                 f"(got amsgrad={group.get('amsgrad')}, maximize={group.get('maximize')}, "
                                 f"differentiable={group.get('differentiable')})")
            if bool(group["adamw"]) != bool(group["decoupled_weight_decay"]):
                raise ValueError(f"CPUAdam param group {gi}: 'adamw'={group['adamw']} contradicts "
                                 f"'decoupled_weight_decay'={group['decoupled_weight_decay']}; set both")
            lr = group["lr"]
            lr = float(lr.item()) if isinstance(lr, torch.Tensor) else float(lr)
            beta1, beta2 = (float(b) for b in group["betas"])
            for pi, p in enumerate(group["params"]):
                if p.grad is None:
                    continue
                self._step_param(p, group, lr, beta1, beta2, f"CPUAdam param group {gi}, parameter {pi}")
        return loss

    def _step_param(self, p, group, lr, beta1, beta2, where):
        grad = p.grad
        if grad.is_sparse:
            raise ValueError(f"{where}: sparse gradients are not supported (use torch.optim.SparseAdam)")
        self._check_param(p, where)
        if grad.device.type != "cpu" or grad.dtype not in _GRAD_DTYPES:
            raise TypeError(f"{where}: gradient on {grad.device} with dtype {grad.dtype}; "
                            "expected a CPU fp32/bf16/fp16 gradient")
        state = self.state[p]
        if len(state) == 0:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        step_t = state["step"]
        if isinstance(step_t, torch.Tensor):
            step_t += 1
            step = int(step_t.item())
        else:  # a plain number from an old state dict
            step = int(step_t) + 1
            state["step"] = torch.tensor(float(step), dtype=torch.float32)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        for name, t in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            if t.shape != p.shape or t.device.type != "cpu":
                raise ValueError(f"{where}: state {name} has shape {tuple(t.shape)} on {t.device}, "
                                 f"parameter has shape {tuple(p.shape)}; was the state dict loaded "
                                 "for another model?")
        # The kernel needs contiguous buffers of the same element order: when a tensor is
        # not contiguous, work on contiguous copies and write them back.
        flat = []
        for t in (p, exp_avg, exp_avg_sq):
            flat.append(t.view(-1) if t.is_contiguous() else t.contiguous().view(-1))
        g = grad.reshape(-1) if grad.is_contiguous() else grad.contiguous().view(-1)
        adam_step(flat[0], g, flat[1], flat[2], step=step, lr=lr, beta1=beta1, beta2=beta2,
                  eps=float(group["eps"]), weight_decay=float(group["weight_decay"]),
                  adamw=bool(group["decoupled_weight_decay"]),
                  bias_correction=bool(group["bias_correction"]))
        for t, f in zip((p, exp_avg, exp_avg_sq), flat):
            if not t.is_contiguous():
                t.copy_(f.view(t.shape))
