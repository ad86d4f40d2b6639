"""How many bytes a forward pass keeps alive for its backward: the measure of activation memory.

:func:`saved_activation_bytes` runs ``fn()`` (a forward that returns tensors with a graph, e.g. the
training objective's ``(loss_sum, n_targets)``) under a ``TorchDispatchMode`` that sees every aten op of
the forward. A storage is *created in the forward* when it first appears as an op's output (storages an
op reads before any op wrote them existed already: parameters, buffers, the batch, so they never count,
and neither do views of them such as ``weight.t()``). After ``fn`` returns, its outputs are dropped while
their ``grad_fn`` is held (the graph stays), garbage is collected, and the figure is the sum of
``untyped_storage().nbytes()`` over the created storages still alive. Whatever holds them counts:

* the tensors autograd saved (``saved_tensors_hooks`` see these too);
* non-reentrant checkpoint's block inputs (held by its frame);
* selective checkpointing's cached op outputs (held in the checkpoint frame, *not* seen by saved-tensor
  hooks, which is why this counts storages rather than hook calls);
* an output saved by its own ``grad_fn`` (e.g. ``exp``).

What the count means, exactly: bytes of the storage (element size of its dtype times its allocated
elements: a BF16 activation is 2 bytes an element, an FP32 one 4); a view shares its base's storage and
counts once with it (``q.view(...).transpose(1, 2)`` saved next to ``q`` adds nothing); each kernel's
extra outputs count when kept (SDPA's logsumexp, FP32, batch x heads x seq; a mask from
``document_causal_mask``); under autocast the BF16 copies of the weights that matmuls save for backward
count (they are made in the forward: the autocast cache is cleared when the outermost autocast exits,
so only the copies backward holds stay alive). Not counted: anything allocated outside the dispatcher
(e.g. an RNG state object; the checkpoints here do not keep one), allocator rounding and fragmentation,
and tensor subclasses (DTensor, FP8 tensors: their inner tensors are not visited). Measure eager code:
under ``torch.compile`` the kernels allocate outside the dispatcher, so the figure would be wrong.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves


def _plain(x: object) -> bool:
    return isinstance(x, torch.Tensor) and not is_traceable_wrapper_subclass(x) and x.device.type != "meta"


class StorageTracker(TorchDispatchMode):
    """Records the storages first produced by an op inside the mode (weakly: nothing is kept alive)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[StorageWeakRef] = set()  # every storage an op read or wrote (holding the weak
        self.created: dict[StorageWeakRef, int] = {}  # reference keeps its address from being reused)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_leaves((args, kwargs or {})):
            if _plain(t):
                self.seen.add(StorageWeakRef(t.untyped_storage()))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if _plain(t):
                ref = StorageWeakRef(t.untyped_storage())
                if ref not in self.seen:
                    self.seen.add(ref)
                    self.created[ref] = t.untyped_storage().nbytes()
        return out

    def alive_bytes(self) -> int:
        """Bytes of the created storages that are still alive."""
        return sum(n for ref, n in self.created.items() if not ref.expired())


def saved_activation_bytes(fn: Callable[[], object]) -> int:
    """Bytes of the storages that ``fn()`` (a forward) created and that its graph keeps alive for backward,
    each storage once (see the module docstring for what counts). ``fn`` runs once; nothing is returned
    of it, and its graph is freed before this returns."""
    tracker = StorageTracker()
    with tracker:
        out = fn()
    graph = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    del out
    gc.collect()
    try:
        return _settled(tracker) if dist.is_available() and dist.is_initialized() else tracker.alive_bytes()
    finally:
        del graph


def _settled(tracker: StorageTracker, interval_s: float = 0.05, reads: int = 3, limit_s: float = 2.0) -> int:
    """``tracker.alive_bytes()`` once it has stopped falling (``reads`` equal reads ``interval_s`` apart,
    at most ``limit_s``). A gloo collective's worker thread drops its reference to the work's tensors a
    moment after the caller's ``wait()`` returned; on a loaded machine that moment measured long enough
    for a forward's all-reduced row maxima to be read as kept (640 bytes for 384 under two busy test
    workers). Only such late releases change the figure: the graph is held still meanwhile."""
    last, same, deadline = tracker.alive_bytes(), 1, time.monotonic() + limit_s
    while same < reads and time.monotonic() < deadline:
        time.sleep(interval_s)
        now = tracker.alive_bytes()
        same = same + 1 if now == last else 1
        last = now
    return last
