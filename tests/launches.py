"""Counting the kernel launches of a block of code, on the CPU as on a GPU.

``with CountLaunches() as n: opt.step()`` then ``n.total`` (and its parts) is what the block
would launch on a GPU:

* ``n.triton``: Triton kernel launches, compiled or interpreted (``TRITON_INTERPRET=1``):
  every ``kernel[grid](...)`` call, counted by wrapping ``run`` of Triton's ``JITFunction``
  and ``InterpretedFunction`` (the method a launch calls, in both modes; warm-up calls that
  only compile are not counted).
* ``n.torch``: torch operators that would be one CUDA kernel each, seen by a
  ``TorchDispatchMode``: an operator counts when it writes memory, i.e. when it mutates an
  argument (in-place and ``out=`` ops) or returns a tensor with new storage. Not counted:
  views and other results that alias an input (``view``, ``t``, a ``to`` that changes
  nothing), allocations without a fill (``empty*``), metadata (``detach_``, ``set_``,
  ``resize_``), and host reads (``_local_scalar_dense``: counted in ``n.host_reads``).
  A composite operator that torch hands to the mode whole (``zeros``, ``ones``) counts once,
  as one fill kernel.
* ``n.copies``: copies between devices (host-to-device tables, device-to-host reads), which
  are memcpy calls rather than kernels; none on the CPU.

rgc's custom operators (``torch.ops.rgc.*``) are not counted themselves: their kernel runs
under the mode, so what it launches is counted. Torch operations that Triton's interpreter
performs to move arguments in and out of a kernel are not counted (they are not part of a
launch on a GPU). With ``device="cuda"``, only operators touching a CUDA tensor count (host
work such as building a seed table is then left out); the default counts every operator.

``n.names`` counts launches by name (``"triton:<kernel>"``, ``"aten.<op>"``), for messages.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_NOT_KERNELS = {
    "aten.empty.memory_format", "aten.empty_strided.default", "aten.empty_like.default",
    "aten.new_empty.default", "aten.new_empty_strided.default", "aten.empty_permuted.default",
    "aten.detach_.default", "aten.set_.source_Storage", "aten.set_.source_Storage_storage_offset",
    "aten.set_.source_Tensor", "aten.set_.default", "aten.resize_.default",
    "aten.as_strided_.default", "aten.lift_fresh.default",
    "aten._pin_memory.default",  # a copy between host buffers
}
_COPIES = {"aten._to_copy.default", "aten.copy_.default", "aten.to.dtype_layout",
           "aten.to.device", "aten.to.other"}


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _storage(t: torch.Tensor) -> tuple:
    return t.device, t.untyped_storage().data_ptr()


class CountLaunches(TorchDispatchMode):
    """Counts the kernels a block launches (see the module docstring)."""

    def __init__(self, device: str | torch.device | None = None):
        super().__init__()
        self.device = None if device is None else torch.device(device).type
        self.triton = self.torch = self.copies = self.host_reads = 0
        self.names: collections.Counter[str] = collections.Counter()
        self._in_launch = self._depth = 0
        self._patched = []

    @property
    def total(self) -> int:
        return self.triton + self.torch + self.copies

    # ------------------------------------------------------------------ Triton launches
    def __enter__(self):
        # Entered again (without re-patching) while an rgc operator's kernel runs.
        if not self._patched:
            import triton.runtime.interpreter as interpreter
            import triton.runtime.jit as jit

            for cls in (jit.JITFunction, interpreter.InterpretedFunction):
                self._patched.append((cls, cls.__dict__["run"]))
                cls.run = self._wrap(cls.__dict__["run"])
        self._depth += 1
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._depth -= 1
            if not self._depth:
                for cls, run in reversed(self._patched):
                    cls.run = run
                self._patched.clear()

    def _wrap(self, run):
        counter = self

        def counted_run(kernel, *args, grid, warmup, **kwargs):
            if not warmup:
                counter.triton += 1
                counter.names[f"triton:{kernel.__name__}"] += 1
            counter._in_launch += 1
            try:
                return run(kernel, *args, grid=grid, warmup=warmup, **kwargs)
            finally:
                counter._in_launch -= 1
        return counted_run

    # --------------------------------------------------------------------- torch ops
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._in_launch:
            return func(*args, **kwargs)
        if func.namespace == "rgc":  # run the kernel itself under this mode
            inputs = list(_tensors([*args, *kwargs.values()]))
            devices = {t.device.type for t in inputs} | {
                torch.device(v).type for v in [*args, *kwargs.values()]
                if isinstance(v, torch.device)}
            key = (torch._C.DispatchKey.CUDA if "cuda" in devices
                   else torch._C.DispatchKey.CPU)
            with self:
                return func._op_dk(key, *args, **kwargs)
        out = func(*args, **kwargs)
        self._classify(func, args, kwargs, out)
        return out

    def _classify(self, func, args, kwargs, out) -> None:
        name = str(func)
        if name == "aten._local_scalar_dense.default":
            self.host_reads += 1
            return
        if name in _NOT_KERNELS:
            return
        inputs = list(_tensors([*args, *kwargs.values()]))
        outputs = list(_tensors([out]))
        if func._schema.is_mutable:  # in-place, out= and foreach forms: a kernel each
            written = outputs or inputs
        else:
            known = {_storage(t) for t in inputs}
            written = [t for t in outputs if _storage(t) not in known]
        if not written:
            return  # a view or an alias of an input
        if self.device is not None and not any(
                t.device.type == self.device for t in [*inputs, *outputs]):
            return
        if name in _COPIES and len({t.device for t in [*inputs, *outputs]}) > 1:
            self.copies += 1
        else:
            self.torch += 1
        self.names[name] += 1

