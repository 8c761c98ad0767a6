"""Measure the memory a block of code really allocates: ``with rgc.memory.track() as t: ...``.

Every tensor an ATen operator returns inside the block is seen by a ``TorchDispatchMode``; a new
storage (one that no input of the operator already owns, so views, ``detach`` and in-place ops
count nothing) is added to the live total when it appears and removed by a ``weakref.finalize``
on its ``UntypedStorage`` when it is freed. ``t.peak`` is the largest live total reached. This
works on every device, CPU included, and sees autograd's backward and optimizer steps.

rgc's own operators (:mod:`rgc.ops`) are followed inside: their torch ops count as any other.
A storage resized in place with ``UntypedStorage.resize_`` (how FSDP2 frees and re-gathers its
unsharded parameters) counts with its new size.
What it cannot see: storages created before the block (model weights built outside it count
nothing: build the model inside the block and call :meth:`Tracker.reset_peak`), tensors made
without an operator (``torch.from_numpy``), and scratch memory a kernel allocates and frees
internally without returning it (a Triton kernel's, or an inductor-compiled loop's). On CUDA
the caching allocator's own count is recorded beside it (:attr:`Tracker.cuda_peak`), which
includes such scratch memory.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import (
    register_optimizer_step_post_hook,
    register_optimizer_step_pre_hook,
)
from torch.utils._python_dispatch import TorchDispatchMode

#: Categories of :attr:`Tracker.peak_breakdown`, by when and why a storage was allocated.
CATEGORIES = ("activations", "backward", "optimizer", "other")


def _tensors(tree, out: list[torch.Tensor]) -> list[torch.Tensor]:
    """Appends to ``out`` the tensors in an operator's arguments or outputs (a tensor, or
    tuples, lists and dicts of them); a plain walk, several times faster per operator than
    ``torch.utils._pytree``'s."""
    if isinstance(tree, torch.Tensor):
        out.append(tree)
    elif isinstance(tree, (tuple, list)):
        for x in tree:
            _tensors(x, out)
    elif isinstance(tree, dict):
        for x in tree.values():
            _tensors(x, out)
    return out


def _storage(t: torch.Tensor):
    """``t``'s UntypedStorage, or None for tensors without one (sparse, nested)."""
    try:
        return t.untyped_storage()
    except (NotImplementedError, RuntimeError):
        return None


@dataclass(frozen=True)
class Allocation:
    """One new storage: the operator that returned it, the tensor's shape and dtype, the
    storage's size in bytes, its device type and its category at allocation time."""

    op: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    device: str
    category: str


class Tracker(TorchDispatchMode):
    """Live-storage accounting; use through :func:`track`.

    Attributes:
        current: bytes of storages allocated in the block and still alive.
        peak: the largest ``current`` reached (since entry or the last :meth:`reset_peak`).
        peak_breakdown: ``{category: bytes}`` at the moment of ``peak``. Categories:
            ``activations`` (storages autograd saved for backward), ``backward`` (allocated
            while autograd runs a backward: gradients, sketches, temporaries), ``optimizer``
            (allocated inside ``Optimizer.step``: state and temporaries), ``other``
            (everything else: weights built in the block, forward temporaries, outputs).
        allocations: every :class:`Allocation`, in order (only if ``record=True``).
        largest: the largest :class:`Allocation` (since entry or :meth:`reset_peak`).
        cuda_peak: on exit, ``torch.cuda.max_memory_allocated() - memory_allocated at entry``
            if CUDA was initialised, else ``None``.
    """

    def __init__(self, *, device: str | None = None, record: bool = True):
        super().__init__()
        self.device = device
        self.record = record
        self.current = 0
        self.peak = 0
        self.peak_breakdown: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.allocations: list[Allocation] = []
        self.largest: Allocation | None = None
        self.cuda_peak: int | None = None
        self._by_category = dict.fromkeys(CATEGORIES, 0)
        self._live: dict[int, tuple[int, str]] = {}  # storage key -> (nbytes, category)
        self._in_optimizer = 0
        self._stack = contextlib.ExitStack()
        self._cuda_base = 0

    # -- public ---------------------------------------------------------------------------
    @property
    def current_breakdown(self) -> dict[str, int]:
        """``{category: bytes}`` live now."""
        return dict(self._by_category)

    def reset_peak(self) -> None:
        """Start a new peak from the current live total (as torch.cuda.reset_peak_memory_stats)."""
        self.peak = self.current
        self.peak_breakdown = dict(self._by_category)
        self.largest = None
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base = torch.cuda.memory_allocated()

    def shapes(self, min_bytes: int = 0) -> set[tuple[int, ...]]:
        """Shapes of all recorded allocations of at least ``min_bytes``."""
        return {a.shape for a in self.allocations if a.nbytes >= min_bytes}

    def assert_no_shape(self, *shapes: tuple[int, ...]) -> None:
        """Raise ``AssertionError`` listing the allocations whose shape is one of ``shapes``."""
        found = [a for a in self.allocations if a.shape in {tuple(s) for s in shapes}]
        if found:
            raise AssertionError(f"forbidden allocation(s): {found[:5]}")

    # -- bookkeeping ----------------------------------------------------------------------
    def _category(self) -> str:
        if self._in_optimizer:
            return "optimizer"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "other"

    def _add(self, key: int, nbytes: int, category: str) -> None:
        self._live[key] = (nbytes, category)
        self.current += nbytes
        self._by_category[category] += nbytes
        if self.current > self.peak:
            self.peak = self.current
            self.peak_breakdown = dict(self._by_category)

    def _free(self, key: int) -> None:
        entry = self._live.pop(key, None)
        if entry is not None:
            self.current -= entry[0]
            self._by_category[entry[1]] -= entry[0]

    def _resized(self, storage, nbytes: int) -> None:
        """Follow ``UntypedStorage.resize_``: FSDP2 frees a gathered parameter by resizing its
        storage to 0 and gathers it again into the same storage, which no operator returns."""
        if self.device is not None and storage.device.type != self.device:
            return
        key = storage._cdata
        entry = self._live.get(key)
        if entry is not None:
            self._free(key)
        if nbytes > 0:
            self._add(key, nbytes, entry[1] if entry is not None else self._category())
            if entry is None:
                weakref.finalize(storage, self._free, key)

    def _pack(self, t: torch.Tensor):
        # Saved for backward: move the storage into 'activations' (once). A saved parameter
        # (or a view of one, as the transposed weight of a matmul) stays where it is.
        st = _storage(t)
        entry = None if st is None else self._live.get(st._cdata)
        is_param = isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter)
        if entry is not None and not is_param and entry[1] not in ("activations", "backward"):
            self._by_category[entry[1]] -= entry[0]
            self._by_category["activations"] += entry[0]
            self._live[st._cdata] = (entry[0], "activations")
        # detach: returning ``t`` itself would tie a saved output to its own grad_fn in a
        # reference cycle, and its storage would then outlive the graph until gc runs.
        return t.detach()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rgc":  # rgc's own operators: count what they allocate inside
            from rgc.ops import run_under_mode

            return run_under_mode(self, func, args, kwargs)
        out = func(*args, **(kwargs or {}))
        outs = _tensors(out, [])
        if not outs:
            return out
        seen = {st._cdata for t in _tensors((args, kwargs), [])
                if (st := _storage(t)) is not None}
        for t in outs:
            if t.device.type == "meta" or (self.device is not None
                                           and t.device.type != self.device):
                continue
            st = _storage(t)
            if st is None:
                continue
            key = st._cdata
            if key in seen or key in self._live:
                continue
            seen.add(key)
            nbytes = st.nbytes()
            if nbytes == 0:
                continue
            category = self._category()
            self._add(key, nbytes, category)
            weakref.finalize(st, self._free, key)
            alloc = Allocation(str(func), tuple(t.shape), t.dtype, nbytes, t.device.type,
                               category)
            if self.record:
                self.allocations.append(alloc)
            if self.largest is None or nbytes > self.largest.nbytes:
                self.largest = alloc
        return out

    def __enter__(self):
        def pre(*_):
            self._in_optimizer += 1

        def post(*_):
            self._in_optimizer -= 1

        self._stack.callback(register_optimizer_step_pre_hook(pre).remove)
        self._stack.callback(register_optimizer_step_post_hook(post).remove)
        self._stack.enter_context(torch.autograd.graph.saved_tensors_hooks(self._pack,
                                                                           lambda t: t))
        resize = torch.UntypedStorage.resize_

        def resized(storage, size):
            out = resize(storage, size)
            self._resized(storage, storage.nbytes())
            return out

        torch.UntypedStorage.resize_ = resized
        self._stack.callback(setattr, torch.UntypedStorage, "resize_", resize)
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats()
            self._cuda_base = torch.cuda.memory_allocated()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._stack.close()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                self.cuda_peak = torch.cuda.max_memory_allocated() - self._cuda_base


def track(*, device: str | None = None, record: bool = True) -> Tracker:
    """Context manager measuring the peak bytes of tensors allocated inside it.

    Args:
        device: count only storages on this device type ('cpu', 'cuda'); ``None`` for all.
        record: keep every :class:`Allocation` in ``tracker.allocations`` (for assertions on
            shapes, e.g. that no d x k tensor was allocated).

    Example::

        with rgc.memory.track() as t:
            loss = model(x).sum(); loss.backward(); opt.step()
        print(t.peak, t.peak_breakdown, t.largest)
        assert (d, k) not in t.shapes()
    """
    return Tracker(device=device, record=record)
