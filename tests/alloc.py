"""A tiny allocation recorder for tests: the shapes of every new tensor an op returns."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class RecordAllocations(TorchDispatchMode):
    """Records ``numel`` of every output of a non-view, non-in-place ATen op."""

    def __init__(self):
        super().__init__()
        self.sizes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        schema = func._schema
        inplace = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if not func.is_view and not inplace:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.sizes.append((str(func), tuple(t.shape)))
        return out

    def largest(self) -> int:
        return max((torch.Size(s).numel() for _, s in self.sizes), default=0)
