"""What one real training step allocates, by category, at its peak: the measurement the planner
(``plan/estimate.py``) is held to.

:func:`measure_step` takes ``warmup`` steps of a run built by ``train/build.py::build_run`` (the optimizer
states exist from the first on), then one more step under PyTorch's own memory tracker: ``FSDPMemTracker``
when the model holds FSDP2 units (it tells sharded from gathered parameters and gradients, and the
all-gather and reduce-scatter buffers), else ``MemTracker``. Both follow every tensor storage through the
dispatcher and keep the snapshot of the moment the device's total was highest; :class:`StepMemory` holds
that snapshot's categories, in bytes, and its module-phase label (which module's forward or backward the
peak fell in, or the optimizer step).

They see tensors only: not the allocator's rounding and caching, not the interpreter, not what kernels
allocate outside the dispatcher (``torch.compile``'s): measure eager runs.

The zero-bubble pipeline schedules (``zero_bubble``, ``zbv``) split each backward in two with
``torch.autograd.grad``, which the trackers' module hooks cannot follow in torch 2.13 ("A leaf node was
passed to _will_engine_execute_node but we are currently running autograd.grad()"). Their steps are
measured by :class:`StoragePeak` instead: the same storage accounting without the module hooks, so the
total only, no categories.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

# the tracker's categories, grouped as the planner's rows (plan/estimate.py::Estimate.rows)
ROWS = {
    "parameters": ("Parameter", "Sharded Param", "Buffer"),
    "gradients": ("Gradient", "Sharded Grad"),
    "optimizer states": ("Optstate", "OptState"),
    "activations": ("Activation",),
    "temporaries": ("Temp", "Unsharded Param", "Unsharded Grad", "All Gather", "Reduce Scatter"),
    "inputs": ("Inputs",),
}


@dataclass
class StepMemory:
    """A step's peak (``total``, bytes of live tensors on the device) and its categories at that moment
    (``categories``: the tracker's names; :meth:`rows`: grouped as the planner's rows)."""

    total: int
    categories: dict[str, int] = field(default_factory=dict)
    states: dict[str, int] = field(default_factory=dict)  # :func:`model_state_bytes` of the measured step

    def rows(self) -> dict[str, int]:
        """The categories summed into the planner's rows (:data:`ROWS`); anything else under ``other``."""
        out = {row: sum(self.categories.get(c, 0) for c in names) for row, names in ROWS.items()}
        known = {c for names in ROWS.values() for c in names}
        out["other"] = sum(v for c, v in self.categories.items() if c not in known)
        return out


def _has_fsdp(module: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def _tracked(run) -> torch.nn.Module:
    """The module the step's forward runs through (the training objective, which holds the model)."""
    fn = getattr(run.module, "train_fn", None)
    return fn if isinstance(fn, torch.nn.Module) else run.model


def take_step(run) -> None:
    """One optimizer step of ``run`` (its ``accum`` micro-batches), as the trainer takes it."""
    from lmforge.train.step import train_step

    batches = [run.loader.next_batch() for _ in range(run.accum)]
    train_step(run.module, run.optimizer, batches, 1e-3, run.clipper, run.precision, reduce=run.reduce)


@contextlib.contextmanager
def _fresh_module_stats(module, tracker):
    """Clear the tracker's per-module statistics before each micro-batch: the trackers refuse a second
    top-level forward of a module within one tracking (gradient accumulation) unless they are cleared
    (``reset_mod_stats``); the step's peak snapshot is kept across it."""
    forward_backward = module.forward_backward

    def fresh(*args, **kwargs):
        tracker.reset_mod_stats()
        return forward_backward(*args, **kwargs)

    module.forward_backward = fresh
    try:
        yield
    finally:
        del module.forward_backward


def _optimizers(optimizer) -> list:
    """``optimizer`` and, for ZeRO-1's ``ZeroRedundancyOptimizer``, the rank's own optimizer inside it
    (``.optim``), which holds the states: the wrapper's ``state`` stays empty, so the tracker would see
    them only once the measured step's optimizer step runs."""
    inner = getattr(optimizer, "optim", None)
    return [optimizer, inner] if isinstance(inner, torch.optim.Optimizer) else [optimizer]


def _peak_tracker():
    """A ``MemTracker`` for a whole step of a pipeline stage: the schedule runs the stage's forward once per
    pipeline micro-batch, before any backward, which ``MemTracker`` refuses as "multiple iterative calls"
    (``reset_mod_stats`` cannot be called in between: the backward hooks of the earlier micro-batches look
    their module up). Only the step's peak snapshot is read here, so a repeated top-level forward starts
    that module's statistics afresh instead (a private hook of torch's tracker is extended for that: no
    public switch exists in torch 2.13)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class PeakTracker(MemTracker):
        def _pre_fw_hook(self, module, inputs) -> None:
            name = self._mod_tracker.get_known_fqn(module)
            parents = set(self._mod_tracker.parents) - {name}
            if module in self.memory_tracking and not self._mod_tracker.is_bw and parents == {"Global"}:
                del self.memory_tracking[module]  # the parameters' gradient hooks stay (installed once)
            super()._pre_fw_hook(module, inputs)

        def _track_module_params_and_buffers(self, module, install_grad_hooks: bool = True):
            # torch's tracker hooks every parameter's gradient, which a frozen one (LoRA's base) refuses:
            # a placeholder handle makes it skip them, removed again before the tracker's own cleanup
            frozen = [p for p in module.parameters() if not p.requires_grad]
            for p in frozen:
                self._param_to_grad_hook_handles.setdefault(p, "frozen")
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                for p in frozen:
                    if self._param_to_grad_hook_handles.get(p) == "frozen":
                        del self._param_to_grad_hook_handles[p]

    return PeakTracker()


def model_state_bytes(model: torch.nn.Module, optimizers: list) -> dict[str, int]:
    """This rank's bytes of the model's state, counted tensor by tensor (a DTensor's local shard;
    ``optim/state_size.py::tensor_bytes``): ``parameters`` (with the buffers), ``gradients`` (those
    alive now) and ``optimizer states`` (of ``optimizers``: ZeRO-1's inner one holds this rank's)."""
    from lmforge.optim.state_size import state_bytes, tensor_bytes

    params = {id(p): p for p in model.parameters()}.values()
    return {
        "parameters": sum(tensor_bytes(p) for p in params) + sum(tensor_bytes(b) for b in model.buffers()),
        "gradients": sum(tensor_bytes(p.grad) for p in params if p.grad is not None),
        "optimizer states": sum(state_bytes(o) for o in optimizers),
    }


class StoragePeak:
    """The most bytes of tensor storage alive at once while it is entered, beside the storages of
    ``known`` (the tensors already counted: the model's and the optimizers'). A storage counts from the
    first operator that returns it, or takes it as an input, until it is freed (a weak reference's
    callback); a view or an in-place result is not a new storage. PyTorch's ``MemTracker``'s accounting
    without its module hooks (module docstring); equal to it on one-process and pipeline steps
    (``tests/test_step_memory.py``). Not for FSDP2, which frees and refills its gathered parameters' storages
    in place (``resize_``), what ``MemTracker`` follows and this does not."""

    def __init__(self, known: list[torch.Tensor] = ()) -> None:
        self.current = self.peak = 0
        self._known = {_storage_key(t) for t in known}
        self._live: dict[int, int] = {}
        self._refs: dict[int, object] = {}

    def _see(self, t: torch.Tensor) -> None:
        key = _storage_key(t)
        if key is None or key in self._known or key in self._live:
            return
        st = t.untyped_storage()
        if st.nbytes() == 0:
            return
        self._live[key] = st.nbytes()
        self._refs[key] = weakref.ref(st, lambda _, k=key: self._freed(k))
        self.current += st.nbytes()
        self.peak = max(self.peak, self.current)

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key)
        self._refs.pop(key, None)

    def __enter__(self) -> StoragePeak:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        see = self._see

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                for t in tree_flatten((args, kwargs))[0]:
                    if isinstance(t, torch.Tensor):
                        see(t)
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        see(t)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


def _storage_key(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage (None: a meta tensor, or a storage FSDP2 has freed)."""
    if t.device.type == "meta":
        return None
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _split_backward(run) -> bool:
    """Whether the run's pipeline schedule splits its backwards with ``autograd.grad`` (zero bubble)."""
    pipeline = getattr(run.module, "pipeline", None)
    return getattr(pipeline, "schedule_name", "") in ("zero_bubble", "zbv")


def _measure_plainly(run) -> StepMemory:
    """One step under :class:`StoragePeak`: the states alive before it (parameters with the buffers,
    optimizer states; no gradients: each step ends with ``zero_grad(set_to_none=True)``) plus what the
    step allocates at most; the states as :func:`measure_step` counts them."""
    if _has_fsdp(run.model):
        raise ValueError("StoragePeak does not follow FSDP2's storage resizing: measure with FSDPMemTracker")
    optimizers = _optimizers(run.optimizer)
    before = model_state_bytes(run.model, optimizers)
    states: dict[str, int] = {}

    def before_step(optimizer, args, kwargs) -> None:
        states.update(model_state_bytes(run.model, []))

    known = [*run.model.parameters(), *run.model.buffers()]
    known += [v for o in optimizers for st in o.state.values() for v in st.values() if torch.is_tensor(v)]
    hook = run.optimizer.register_step_pre_hook(before_step)
    try:
        with StoragePeak(known) as peak:
            take_step(run)
    finally:
        hook.remove()
    states["optimizer states"] = model_state_bytes(run.model, optimizers)["optimizer states"]
    base = before["parameters"] + before["optimizer states"] + before["gradients"]
    return StepMemory(base + peak.peak, {}, states)


def measure_step(run, warmup: int = 1) -> StepMemory:
    """``warmup`` steps, then the peak of one step under the tracker (module docstring)."""
    for _ in range(warmup):
        take_step(run)
    if _split_backward(run):
        return _measure_plainly(run)
    module = _tracked(run)
    if _has_fsdp(module):
        from torch.distributed._tools.fsdp2_mem_tracker import FSDPMemTracker

        tracker = FSDPMemTracker(module, run.optimizer)
    else:
        tracker = _peak_tracker()
        tracker.track_external(run.model, *_optimizers(run.optimizer))
    states: dict[str, int] = {}

    def before_step(optimizer, args, kwargs) -> None:  # every gradient of the step exists, once
        states.update(model_state_bytes(run.model, []))

    hook = run.optimizer.register_step_pre_hook(before_step)
    try:
        with tracker, _fresh_module_stats(run.module, tracker):
            take_step(run)
    finally:
        hook.remove()
    states["optimizer states"] = model_state_bytes(run.model, _optimizers(run.optimizer))["optimizer states"]
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    categories = {str(getattr(k, "value", k)): int(v) for k, v in peak.items()}
    total = categories.pop("Total")
    return StepMemory(total, categories, states)


def optimizer_step_scratch(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    step: Callable[[], object] | None = None,
    extra: tuple[torch.optim.Optimizer, ...] = (),
    warmup: int = 1,
) -> int:
    """What ``step()`` (default ``optimizer.step``) allocates above what is live when it begins, at its
    peak, under ``MemTracker``: the step's own scratch (``plan/memory.py::optimizer_step_bytes``).
    ``warmup`` steps first, so that every state exists; each step gets fresh random gradients. ``extra``:
    more optimizers whose states the tracker must know from the start (ZeRO-1's inner one, else its
    states count as allocated by the step)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    params = list(model.parameters())
    for i in range(warmup + 1):
        for p in params:
            p.grad = torch.randn_like(p)
        if i < warmup:
            optimizer.step()
    tracker = MemTracker()
    tracker.track_external(model, optimizer, *extra)

    def total(which: str) -> int:
        (snap,) = tracker.get_tracker_snapshot(which).values()
        return next(v for k, v in snap.items() if str(getattr(k, "value", k)) == "Total")

    with tracker:
        base = total("current")
        (step or optimizer.step)()
    return total("peak") - base
