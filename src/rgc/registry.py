"""Which sketched weight a Parameter belongs to, and the weight dtypes rgc updates.

A leaf module (it imports nothing from rgc), so that layers, guards, optimizers and sync code
can all ask "is this Parameter sketched, and by whom?" without importing one another. The
modules holding sketched weights share :class:`SketchedModule`, which keeps the registry in step
when a weight is replaced, moved or cast.

An *owner* is the object that holds a weight's projection and sketch: a
:class:`rgc.CompressedLinear` for a 2-D weight, or the handle of one 3-D expert weight of an
experts module (see :class:`rgc.sketched.SketchedWeight` for what every owner provides).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn as nn

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


class SketchedModule(nn.Module):
    """Mixin of the modules holding sketched weights (:class:`rgc.CompressedLinear`, sketched
    experts): keeps the registry, the sketch slots and the projections in step with the weights.

    Subclasses give :meth:`owners_by_attribute` (``{attribute name: owner}``). A wrapper that
    installs a new Parameter object (FSDP2's ``fully_shard`` swaps a sharded DTensor and the
    gathered weight around forward) keeps ``sketched_owner_of(param)`` working for whatever
    Parameter the optimizer was given; ``.to()``/``.cuda()`` re-register the weights, move the
    sketch slots, and after a cast regenerate ``P`` in the new dtype: ``P`` is a function of
    (seed, version, dtype), so a resumed run, which regenerates it, uses the same bits.
    """

    def owners_by_attribute(self) -> dict:
        raise NotImplementedError

    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if not isinstance(self, SketchedModule):  # `module.__class__ = base` just unwrapped it
            return
        owner = self.owners_by_attribute().get(name)
        if owner is not None and isinstance(value, torch.Tensor):
            register_owner(value, owner)

    def _apply(self, fn, recurse=True):
        owners = self.owners_by_attribute()
        dtypes = {name: owner.weight.dtype for name, owner in owners.items()}
        super()._apply(fn, recurse)
        for name, owner in owners.items():
            owner._register()
            slot = getattr(owner, "_sketch_slot", None)
            if slot is not None and slot.device != owner.weight.device:
                owner._new_sketch_slot()
            projection = getattr(owner, "projection", None)
            if (owner.weight.dtype != dtypes[name] and projection is not None
                    and projection.device.type != "meta"):
                owner.set_projection_version(owner.projection_version)
        return self
