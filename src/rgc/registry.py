"""Which sketched weight a Parameter belongs to, and the weight dtypes rgc updates.

A leaf module (it imports nothing from rgc), so that layers, guards, optimizers and sync code
can all ask "is this Parameter sketched, and by whom?" without importing one another.

An *owner* is the object that holds a weight's projection and sketch: a
:class:`rgc.CompressedLinear` for a 2-D weight, or the handle of one 3-D expert weight of an
experts module (see :class:`rgc.sketched.SketchedWeight` for what every owner provides).
"""

from __future__ import annotations

import weakref

import torch

#: Dtypes of the weights rgc trains from sketches.
SUPPORTED_WEIGHT_DTYPES = (torch.bfloat16, torch.float32)

# id(weight) -> (weakref to weight, weakref to its owner). Keyed by id because tensors compare
# elementwise, which rules out a WeakKeyDictionary.
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def register_owner(weight: torch.Tensor, owner) -> None:
    """Record that ``owner`` sketches ``weight`` (both held weakly)."""
    key = id(weight)
    entry = _OWNERS.get(key)
    if entry is not None and entry[0]() is weight and entry[1]() is owner:
        return
    _OWNERS[key] = (weakref.ref(weight, lambda _: _OWNERS.pop(key, None)), weakref.ref(owner))


def unregister_owner(weight: torch.Tensor, owner) -> None:
    """Forget that ``owner`` sketches ``weight`` (a no-op if another owner took its place)."""
    entry = _OWNERS.get(id(weight))
    if entry is not None and entry[0]() is weight and entry[1]() is owner:
        del _OWNERS[id(weight)]


def sketched_owner_of(param: torch.Tensor):
    """The owner (a :class:`rgc.sketched.SketchedWeight`) whose weight is ``param``, or ``None``."""
    entry = _OWNERS.get(id(param))
    if entry is None or entry[0]() is not param:
        return None
    return entry[1]()
