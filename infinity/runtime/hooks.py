"""Module, autograd and gradient hooks that page parameter groups around compute.

* forward pre-hook: fetch the module's groups (through the prefetch coordinator);
  forward post-hook: release them (outside backward).
* saved-tensor hooks (pushed by the outermost managed module's forward in grad mode):
  a tensor autograd saves that lives in a paged group's buffer (the parameter itself,
  or a view such as ``weight.t()``) is packed as a small reference (group, offset,
  sizes, strides) instead of pinning the buffer; unpacking it in backward fetches the
  group again (prefetched from the trace) and rebuilds the view.  When the last
  reference to a group is dropped in backward, the group is released.
* post-accumulate-grad hooks: move each parameter's gradient into its group's fp32
  accumulation buffer and free it.
* Recomputation (activation checkpointing) runs forward hooks inside backward: the
  groups it fetches are held until their gradients have arrived (trainable) or until
  the end of that backward (frozen).
* activation offload (optional, :mod:`infinity.runtime.activations`): any other saved
  tensor packed in forward goes to the host tier or NVMe and comes back in backward.
"""
from __future__ import annotations

import functools
import logging
import time

import torch
from torch import nn

from infinity.memory.frozen_quant import is_conv1d
from infinity.memory.manager import MemoryManager
from infinity.memory.record import GroupRecord, Location
from infinity.runtime.activations import ActivationOffload, SavedActivation, SavedView
from infinity.runtime.groups import Grouping
from infinity.runtime.interrupts import InterruptGate, never_raise_in
from infinity.runtime.prefetch import PrefetchCoordinator

log = logging.getLogger("infinity.runtime")

__all__ = ["ParamHooks", "in_backward"]


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class _SavedRef:
    """A saved tensor that lives in a paged group's buffer, kept as coordinates only."""
    __slots__ = ("owner", "g", "rel", "size", "stride", "epoch", "__weakref__")

    def __init__(self, owner: "ParamHooks", g: GroupRecord, t: torch.Tensor):
        self.owner = owner
        self.g = g
        self.rel = t.storage_offset() - g.device_buf.storage_offset()
        self.size = tuple(t.shape)
        self.stride = tuple(t.stride())
        self.epoch = owner.epoch          # refs of an abandoned window no longer count
        g.saved_refs += 1

    def __del__(self):
        owner = getattr(self, "owner", None)      # (None: __init__ did not finish)
        if owner is None or getattr(self, "epoch", None) != owner.epoch:
            return
        try:
            with owner.gate.quiet():      # (a destructor: a held signal waits, Note [held interrupts])
                owner._ref_dropped(self.g)
        except Exception as e:  # a destructor must not raise: the error is logged, and
            # the next backward's finish_backward releases the group anyway
            log.warning("infinity: releasing group %s after its last saved tensor was dropped "
                        "failed: %s", getattr(self.g, "name", "?"), e)


never_raise_in(_SavedRef.__del__)


def _input_grad_ends_use(module: nn.Module) -> bool:
    """Whether the gradient of ``module``'s one input is the last of its backward that
    needs its weight (Note [Recomputed frozen groups])."""
    return type(module) is nn.Linear or is_conv1d(module)


class ParamHooks:
    def __init__(self, model: nn.Module, grouping: Grouping, manager: MemoryManager,
                 coordinator: PrefetchCoordinator, on_grad, gate: InterruptGate | None = None,
                 activations: ActivationOffload | None = None):
        self.model = model
        self.acts = activations           # activation offload (None: activations stay)
        # every hook body runs inside the gate: a signal never splits its bookkeeping
        # (Note [held interrupts] in infinity.runtime.interrupts)
        self.gate = gate if gate is not None else InterruptGate()
        self._pack_hook, self._unpack_hook = self._gated(self._pack), self._gated(self._unpack)
        self._end_backward_hook = self._gated(self._end_backward)
        self.grouping = grouping
        self.mm = manager
        self.coord = coordinator
        self.on_grad = on_grad            # callable(group, slot, grad tensor)
        self.handles: list = []
        self._slot_of: dict[int, tuple[GroupRecord, int]] = {}
        self._saved_ctx = []              # stack of entered saved_tensors_hooks contexts
        self._fwd_depth = 0
        self._bw_callback_queued = False
        self._owner_count: dict | None = None   # gid -> modules fetching it (_owners)
        self.enabled = True
        self.epoch = 0                    # bumped by reset(): saved refs of older windows are inert
        # profiling (only when the timeline is enabled): per-module forward spans and
        # per-group backward spans (first use in backward -> last gradient arrived)
        self._names: dict | None = None
        self._fwd_t0: dict[int, list[float]] = {}
        self._bw_span: dict[str, list[float]] = {}

    # ------------------------------------------------------------------ install
    def _gated(self, fn):
        """``fn`` run as a hook body (Note [held interrupts])."""
        gate = self.gate

        def body(*args):
            with gate:
                return fn(*args)
        return body

    def install(self) -> None:
        root = self.model
        self.handles.append(root.register_forward_pre_hook(self._gated(self._root_pre),
                                                           prepend=True))
        self.handles.append(root.register_forward_hook(self._gated(self._root_post),
                                                       always_call=True))
        for mod, groups in self.grouping.module_groups.items():
            self._install_module(mod, groups)
        grad_hook = self._gated(self._grad_hook)
        for g in self.grouping.groups:
            for i, s in enumerate(g.slots):
                self._slot_of[id(s.param)] = (g, i)
                if s.trainable:
                    self.handles.append(s.param.register_post_accumulate_grad_hook(grad_hook))

    def _install_module(self, mod: nn.Module, groups: list[GroupRecord]) -> None:
        self.handles.append(mod.register_forward_pre_hook(self._gated(self._make_pre(groups))))
        self.handles.append(mod.register_forward_hook(self._gated(self._make_post(groups)),
                                                      always_call=True))

    def add_external(self, module: nn.Module, g: GroupRecord) -> None:
        """Make ``module``'s forward fetch group ``g`` too (a parameter used outside the
        module that owns it, e.g. ``F.linear(h, self.embed.weight)`` in a parent)."""
        groups = self.grouping.module_groups.get(module)
        if groups is not None and any(x.users for x in groups):
            raise RuntimeError("register_external_parameter: the module is executing; "
                               "register before forward")
        if groups is None:
            groups = self.grouping.module_groups[module] = [g]
            self._install_module(module, groups)
        elif g not in groups:
            groups.append(g)
        self._owner_count = None

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
        while self._saved_ctx:
            ctx = self._saved_ctx.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
        if self.acts is not None:
            self.acts.close()

    def reset(self) -> None:
        """After a failed forward/backward (Note [window abort] in infinity.engine.phase):
        forget every module that was executing (a ``KeyboardInterrupt`` skips the post
        hooks), leave the saved-tensor hooks, make saved references of the failed window
        inert, and end the prefetch pass.  The caller releases the groups."""
        while self._saved_ctx:
            ctx = self._saved_ctx.pop()
            if ctx is not None:
                try:
                    ctx.__exit__(None, None, None)
                except Exception as e:  # noqa: BLE001 - keep resetting
                    log.debug("infinity: leaving saved-tensor hooks: %s", e)
        self._fwd_depth = 0
        self._bw_callback_queued = False
        self._fwd_t0.clear()
        self._bw_span.clear()
        self.epoch += 1
        if self.acts is not None:         # no offloaded activation of the failed graph stays
            self.acts.release_all()
        for g in self.grouping.groups:
            for sl in g.slots:            # a gradient the interrupted hook did not take
                sl.param.grad = None      # would be added to the next backward's
            g.users = 0
            g.saved_refs = 0
            g.hold_until_backward_end = False
            g.recompute_users = 0
            g.grads_pending = set()
        self.coord.abandon_pass()

    # ------------------------------------------------------------------ root
    def _training_pass(self) -> bool:
        return torch.is_grad_enabled() and self.model.training and not in_backward()

    def _root_pre(self, module, args):
        if in_backward():
            return
        if self._fwd_depth == 0:
            if self._training_pass():
                self.coord.begin_pass()
            if torch.is_grad_enabled():
                if self.acts is not None:
                    self.acts.begin_pass()
                ctx = torch.autograd.graph.saved_tensors_hooks(self._pack_hook,
                                                               self._unpack_hook)
                ctx.__enter__()
                self._saved_ctx.append(ctx)
            else:
                self._saved_ctx.append(None)
        self._fwd_depth += 1

    def _root_post(self, module, args, output):
        if in_backward():
            return
        self._fwd_depth -= 1
        if self._fwd_depth == 0 and self._saved_ctx:
            ctx = self._saved_ctx.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
                if self.acts is not None:
                    self.acts.end_forward()

    # ------------------------------------------------------------------ modules
    def _profiling(self):
        tl = self.mm.timeline
        return tl if tl is not None and tl.enabled else None

    def _module_name(self, module) -> str:
        if self._names is None:
            self._names = {id(m): n or "<root>" for n, m in self.model.named_modules()}
        return self._names.get(id(module), type(module).__name__)

    def _bw_touch(self, g: GroupRecord, start: bool) -> None:
        now = time.perf_counter()
        span = self._bw_span.get(g.name)
        if span is None:
            if start:
                self._bw_span[g.name] = [now, now]
        else:
            span[1] = now

    def _make_pre(self, groups: list[GroupRecord]):
        def pre(module, args):
            bw = in_backward()
            if not bw and self._profiling() is not None:
                self._fwd_t0.setdefault(id(module), []).append(time.perf_counter())
            track = bw or self._training_pass()
            for g in groups:
                self.coord.use(g, track=track)
                g.users += 1
                if bw:
                    self._mark_backward(g, recompute=True)
        return pre

    def _make_post(self, groups: list[GroupRecord]):
        def post(module, args, output):
            bw = in_backward()
            tl = self._profiling()
            if not bw and tl is not None:
                starts = self._fwd_t0.get(id(module))
                if starts:
                    tl.add("forward", self._module_name(module), starts.pop(),
                           time.perf_counter())
            for g in groups:
                g.users -= 1
                if g.users == 0 and not bw:
                    self.coord.release(g)
                elif g.users == 0 and bw:
                    self._maybe_release_bw(g)
            if not bw and len(args) == 1 and isinstance(args[0], torch.Tensor) \
                    and args[0].requires_grad and _input_grad_ends_use(module) \
                    and self._training_pass():
                frozen = [g for g in groups if not g.trainable and self.mm.paged(g)
                          and self._owners(g) == 1]
                if frozen:                    # Note [Recomputed frozen groups]
                    done = functools.partial(self._input_grad_done, frozen, self.epoch)
                    args[0].register_hook(self._gated(done))
        return post

    def _owners(self, g: GroupRecord) -> int:
        """How many modules fetch ``g`` (tied weights, external parameters: several)."""
        if self._owner_count is None:
            counts: dict[int, int] = {}
            for gs in self.grouping.module_groups.values():
                for x in gs:
                    counts[x.gid] = counts.get(x.gid, 0) + 1
            self._owner_count = counts
        return self._owner_count.get(g.gid, 0)

    # ------------------------------------------------------------------ saved tensors
    def _pack(self, t: torch.Tensor):
        try:
            ptr = t.untyped_storage().data_ptr()
        except Exception:  # sparse / nested / exotic subclasses: keep as is
            return t
        g = self.mm.group_of_storage(ptr)
        if g is None or g.device_buf is None:
            if self.acts is not None and not in_backward():
                return self.acts.pack(t)
            return t
        if t.dtype != g.device_buf.dtype:
            return t.clone()      # a reinterpreting view of a paged buffer: keep a copy
        return _SavedRef(self, g, t)

    def _unpack(self, x):
        if not isinstance(x, _SavedRef):
            if isinstance(x, (SavedActivation, SavedView)):
                return self.acts.unpack(x)
            return x
        g = x.g
        if self._profiling() is not None:
            self._bw_touch(g, start=True)
        self.coord.use(g, track=True, kind="unpack")
        self._mark_backward(g, recompute=False)
        buf = g.device_buf
        return buf.as_strided(x.size, x.stride, buf.storage_offset() + x.rel)

    def _ref_dropped(self, g: GroupRecord) -> None:
        g.saved_refs -= 1
        if g.saved_refs == 0 and in_backward():
            self._maybe_release_bw(g)

    # ------------------------------------------------------------------ backward
    def _mark_backward(self, g: GroupRecord, *, recompute: bool) -> None:
        if not self._bw_callback_queued:
            self._bw_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_hook)
        if recompute:
            g.hold_until_backward_end = True
            g.grads_pending = {i for i, s in enumerate(g.slots) if s.trainable}
            if not g.grads_pending:
                g.recompute_users += 1

    # Note [Recomputed frozen groups]
    # ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
    # A group fetched by a recompute (activation checkpointing, in backward) is held: the
    # non-reentrant checkpoint keeps the recomputed tensors itself, outside the saved-tensor
    # hooks, so ``saved_refs`` cannot say when they are gone.  A trainable group goes when
    # its gradients arrived (``grads_pending``); a frozen one gets none, and held to the end
    # of the backward every recomputed frozen layer of a LoRA model would be fetched at once
    # (the whole base in the working precision).  So a module's forward (outside backward)
    # registers, when its input requires grad, a hook on that input's gradient: it fires
    # once the module's backward has run -- the recomputed tensors of that use are spent --
    # and counts one recomputed use done (``recompute_users``, incremented by each recompute
    # of a frozen group); at zero the hold ends and the group goes as any other.  Only where
    # that is exact: a module whose one input's gradient is the last thing its backward
    # computes from the weight (``nn.Linear``, GPT-2's ``Conv1D``: grad_input = grad_out @ W;
    # a frozen W needs no gradient of its own), the group fetched by that module alone.
    # Anything else -- a module applying the weight to several inputs or to a parameter, a
    # group shared by several modules (tied, external), an input that needs no gradient
    # (token ids), reentrant checkpointing (its forward runs without grad) -- is held to the
    # end of the backward, as before.
    def _input_grad_done(self, groups, epoch, grad) -> None:
        if epoch != self.epoch:
            return                        # a graph of an abandoned window
        for g in groups:
            if g.recompute_users > 0:
                g.recompute_users -= 1
                if g.recompute_users == 0 and not g.grads_pending:
                    g.hold_until_backward_end = False
                    self._maybe_release_bw(g)

    def _maybe_release_bw(self, g: GroupRecord) -> None:
        if g.users == 0 and g.saved_refs == 0 and not g.hold_until_backward_end \
                and not g.prefetched and g.state is Location.DEVICE:
            self.coord.release(g)

    def _grad_hook(self, p: torch.Tensor) -> None:
        g, i = self._slot_of[id(p)]
        grad = p.grad
        p.grad = None
        if grad is not None:
            self.on_grad(g, g.slots[i], grad)
            if self._profiling() is not None:
                self._bw_touch(g, start=True)
        if in_backward() and not self._bw_callback_queued:
            self._bw_callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward_hook)
        if g.hold_until_backward_end and g.grads_pending:
            g.grads_pending.discard(i)
            if not g.grads_pending:
                g.hold_until_backward_end = False
                self._maybe_release_bw(g)

    def _end_backward(self) -> None:
        self._bw_callback_queued = False
        tl = self._profiling()
        if tl is not None:
            for name, (t0, t1) in self._bw_span.items():
                tl.add("backward", name or "<root>", t0, t1)
        self._bw_span.clear()
        self.finish_backward()
        if self.acts is not None:
            self.acts.end_backward()

    def finish_backward(self) -> None:
        """Release everything still fetched (called at the end of each backward)."""
        for g in self.mm.groups:
            g.hold_until_backward_end = False
            g.recompute_users = 0
            g.grads_pending = set()
            if g.users == 0 and self.mm.paged(g) and not g.prefetched:
                self.mm.release(g)
        self.coord.end_pass()
