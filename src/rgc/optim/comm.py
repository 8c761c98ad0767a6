"""How the processes that train one model talk during a step: the strategy interface.

A :class:`rgc.optim.SketchOptimizer` step runs one pipeline, *gather -> measure -> reduce ->
propose -> scale -> apply -> finish* (see :mod:`rgc.optim.base`); where processes must
exchange something, it asks its communication strategy. :class:`Local` is one process and
exchanges nothing; :class:`rgc.distributed.DataParallel` (every rank holds every parameter
whole) and :class:`rgc.distributed.FSDP2` (``Shard(0)`` row shards) implement the same
methods with collectives. The rule never sees which one runs.
"""

from __future__ import annotations

import torch

from rgc.payload import KeptUpdate, fingerprint_tensor
from rgc.updates import LowRankUpdate, StackUpdate

__all__ = ["Local", "kept_records"]


def _is_dtensor(t: torch.Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.5
        from torch.distributed._tensor import DTensor
    return isinstance(t, DTensor)


def kept_records(update) -> list[KeptUpdate]:
    """A :class:`rgc.payload.KeptUpdate` per parameter of ``update`` (a
    :class:`rgc.updates.StackUpdate` or :class:`rgc.updates.DenseUpdate`), with the factors
    copied (the sketches are cleared after the step)."""
    kept = []
    for m in (update.members() if isinstance(update, StackUpdate) else [update]):
        if isinstance(m, LowRankUpdate):
            m.factor = m.factor.clone()
            kept.append(KeptUpdate(m, fingerprint_tensor(m.param), m.layer.projection_seed))
        else:
            kept.append(KeptUpdate(m, fingerprint_tensor(m.param), None))
    return kept


class Local:
    """One process: every parameter is whole here, so nothing is exchanged.

    The methods, in the order a step calls them (a distributed strategy overrides what it
    needs; every rank must call them in the same order):

    * ``attach(optimizer)``: once, at the end of the optimizer's construction (check the
      parameters, agree on seeds).
    * ``exchange(params) -> dict``: before the step's entries are made, with the trainable
      parameters; returns what ``view`` needs (e.g. averaged or reduce-scattered sketches).
    * ``view(entry, exchanged) -> Entry``: the entry of the rows of a parameter this process
      updates (the whole parameter here).
    * ``reduce(measured)``: complete the rule's partial sums over the processes, in place
      (``measured``: ``(entries, Partials)`` pairs).
    * ``keeps_weight_norm(entry) -> bool``: whether ``||W_new||^2`` of the entry may be kept in
      the optimizer state for the next step (not for a rank's share of a weight).
    * ``whole_updates(updates)``, ``sum_over_ranks(values)``: what a step controller sees.
    * ``keep(update) -> list``, ``payload_records(records) -> list``: the kept records of an
      applied update (taken before it is applied), and those records as records of whole
      parameters for a sync payload (:func:`rgc.payload.build_payload`).
    * ``finish()``: after the step.
    """

    #: whether ``exchange`` changes the sketches and gradients (so that their norm is known
    #: only inside ``step()``; see :meth:`rgc.optim.SketchOptimizer.clip_at_step`)
    exchanges = False
    #: bytes this process passed to collectives in the last step / the last export
    last_comm_bytes = 0
    last_export_bytes = 0

    def attach(self, optimizer) -> None:
        """Refuse sharded (DTensor) parameters: this process holds only part of them."""
        sharded = [tuple(p.shape) for g in optimizer.param_groups for p in g["params"]
                   if _is_dtensor(p)]
        if sharded:
            raise ValueError(
                f"{type(optimizer).__name__} was given {len(sharded)} sharded DTensor "
                f"parameter(s) (e.g. {sharded[0]}, from FSDP2's fully_shard) but no "
                "communication strategy: use rgc.DistributedRGCOptimizer or "
                "rgc.DistributedRowAdam (or comm=rgc.distributed.communication(params))")

    def exchange(self, params: list[torch.Tensor]) -> dict:
        return {}

    def view(self, entry, exchanged: dict):
        return entry

    def reduce(self, measured: list) -> None:
        pass

    def keeps_weight_norm(self, entry) -> bool:
        return True

    def whole_updates(self, updates: list) -> list:
        return updates

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return values

    def keep(self, update) -> list:
        return kept_records(update)

    def payload_records(self, records: list) -> list:
        return records

    def finish(self) -> None:
        pass
