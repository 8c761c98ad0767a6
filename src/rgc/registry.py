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

# id(weight) -> weak reference to its owner. Keyed by id because tensors compare elementwise
# (no WeakKeyDictionary), and never holding a weak reference to the weight itself: torch's
# parameter swap (``torch.utils.swap_tensors``, used by FSDP2 and ``nn.Module._apply``) refuses
# tensors that have one. A lookup checks that the owner's current weight is the tensor asked
# about, so an id reused by another tensor never matches; each owner holds one entry, moved
# when its weight is replaced.
_OWNERS: dict[int, weakref.ref] = {}


def register_owner(weight: torch.Tensor, owner) -> None:
    """Record that ``owner`` sketches ``weight`` (the owner held weakly, the weight not at all;
    ``owner.weight`` must be ``weight``)."""
    key = id(weight)
    previous = getattr(owner, "_registry_key", None)
    if previous is not None and previous != key:
        unregister_owner_key(previous, owner)
    ref = _OWNERS.get(key)
    if ref is not None and ref() is owner:
        return
    _OWNERS[key] = weakref.ref(owner, lambda r: _OWNERS.pop(key) if _OWNERS.get(key) is r
                               else None)
    owner._registry_key = key


def unregister_owner_key(key: int, owner) -> None:
    """Drop the entry ``key`` if it belongs to ``owner``."""
    ref = _OWNERS.get(key)
    if ref is not None and ref() is owner:
        del _OWNERS[key]


def unregister_owner(weight: torch.Tensor, owner) -> None:
    """Forget that ``owner`` sketches ``weight`` (a no-op if another owner took its place)."""
    unregister_owner_key(id(weight), owner)


def sketched_owner_of(param: torch.Tensor):
    """The owner (a :class:`rgc.sketched.SketchedWeight`) whose weight is ``param``, or ``None``."""
    ref = _OWNERS.get(id(param))
    owner = ref() if ref is not None else None
    if owner is None or owner.weight is not param:
        return None
    return owner


class SketchedModule(nn.Module):
    """Mixin of the modules holding sketched weights (:class:`rgc.CompressedLinear`, sketched
    experts): keeps the registry, the sketch slots and the projections in step with the weights.

    Subclasses give :meth:`owners_by_attribute` (``{attribute name: owner}``). A wrapper that
    installs a new Parameter object (FSDP2's ``fully_shard`` swaps a sharded DTensor and the
    gathered weight around forward) keeps ``sketched_owner_of(param)`` working for whatever
    Parameter the optimizer was given; ``.to()``/``.cuda()`` re-register the weights, move the
    sketch slots, and after a cast regenerate ``P`` in the new dtype: ``P`` is a function of
    (seed, version, dtype), so a resumed run, which regenerates it, uses the same bits.

    A module wrapped on the meta device gets its ``P`` made from its seed when it is
    materialised (``to_empty``, FSDP2's sharding then ``to_empty``), or at its first forward if
    its weights were given otherwise (``load_state_dict(..., assign=True)``): never read from
    uninitialised memory.
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
        before = {name: (owner.weight.dtype, owner.projection.is_meta)
                  for name, owner in owners.items()}
        super()._apply(fn, recurse)
        for name, owner in owners.items():
            owner._register()
            slot = getattr(owner, "_sketch_slot", None)
            if slot is not None and slot.device != owner.weight.device:
                owner._new_sketch_slot()
            dtype, was_meta = before[name]
            if owner.projection.is_meta:
                continue
            if was_meta:  # materialised (to_empty): the buffer holds whatever memory it got
                owner.materialise_projection()
            elif owner.weight.dtype != dtype:
                owner.set_projection_version(owner.projection_version)
        return self
