"""Peak bytes of live tensors, measured (the one place to swap for ``rgc.memory.track``).

On the CPU there is no allocator counter, so :class:`LiveTensorTracker` watches every tensor
an operator returns (a ``TorchDispatchMode``, which also sees the backward pass) and counts the
bytes of each new storage until its finalizer runs. Tensors alive before tracking started are
counted once through ``baseline`` (weights, optimizer state).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


class LiveTensorTracker(TorchDispatchMode):
    """Counts bytes of tensors created while active; ``peak`` is the high-water mark.

    Use as a context manager; ``reset_peak()`` starts a new high-water mark from the bytes
    currently live (for the peak of one phase inside a longer tracked region).
    """

    def __init__(self, baseline: int = 0):
        super().__init__()
        self.baseline = int(baseline)
        self.live = 0
        self.peak = self.baseline
        self._tracked: set[int] = set()

    def _release(self, key: int, nbytes: int) -> None:
        self._tracked.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                s = t.untyped_storage()
                key = id(s)
                if key not in self._tracked:
                    self._tracked.add(key)
                    self.live += s.nbytes()
                    weakref.finalize(s, self._release, key, s.nbytes())
        self.peak = max(self.peak, self.baseline + self.live)
        return out

    def reset_peak(self) -> None:
        self.peak = self.baseline + self.live


def track(baseline_tensors: Iterable[torch.Tensor] = ()) -> LiveTensorTracker:
    """A tracker whose baseline is the bytes of ``baseline_tensors`` (alive before it starts).

    ``with track(tensors) as m: ...`` then ``m.peak`` (bytes). CPU only.
    """
    return LiveTensorTracker(storage_bytes(baseline_tensors))
