"""Counting host reads of tensor values in tests.

A host read (``.item()``, ``float(t)``, ``bool(t)``, ``if t == 0``) runs
``aten._local_scalar_dense``, which on a GPU synchronises the host with the device.
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rgc.ops import run_under_mode


class CountHostReads(TorchDispatchMode):
    """``with CountHostReads() as reads: ...``; then ``reads.count`` is the number of reads."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rgc":  # look inside rgc's operators too
            return run_under_mode(self, func, args, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
