"""Multi-process training on ``torch.distributed``: data parallel and FSDP2.

What crosses the network is the d x r FP32 sketch ``C`` of each compressed weight, never its
d x k gradient. Because ``C = G P`` is linear in the gradient, averaging sketches equals
sketching the averaged gradient: the reduction is exact, with no error feedback.

Data parallel (every rank holds the whole model; ``torchrun`` starts one process per device)::

    model = rgc.wrap(model, rank=64, seed=0)          # the same seed on every rank
    opt = rgc.distributed.DistributedRGCOptimizer(model.parameters(), lr=tau)
    loss.backward()                                   # loss on this rank's share of the batch
    opt.step()                                        # averages sketches and grads, then updates
    opt.zero_grad()

Do not wrap the model in ``DistributedDataParallel``: see :func:`all_reduce_sketches`.

FSDP2: ``rgc.wrap`` first, then ``torch.distributed.fsdp.fully_shard`` (weights become
``Shard(0)`` DTensors). The same optimizer reduce-scatters each sketch to the rows a rank owns,
all-reduces the squared norms ``||W||^2`` and ``||H||^2`` (a few scalars per layer) and updates
only the local rows, with the rounding bits those rows have in the unsharded weight. Other
trainable parameters get FSDP's usual reduce-scattered gradients.

The optimizer checks at construction, with one all-gather of a few integers, that every rank
has the same projection seeds and versions and the same rounding seeds.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

from rgc.nn import compressed_layer_of
from rgc.optim.base import Entry, group_lr, rounding_seed
from rgc.optim.rgc import RGCOptimizer, normalized_coef
from rgc.registry import sketched_owner_of
from rgc.seeding import derive_seed
from rgc.updates import apply_dense_update_, apply_lowrank_update_, sum_squares

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor, Shard

__all__ = ["DistributedRGCOptimizer", "all_reduce_sketches", "check_seeds"]

DEFAULT_BUCKET_MB = 25.0

_FINGERPRINT_FIELDS = (
    "parameter count and shapes",
    "projection seeds (CompressedLinear.seed)",
    "projection versions",
    "rank / projection kind / refresh schedule",
    "rounding seeds (optimizer seed and per-parameter step counts)",
)

_DDP_HINT = (
    "Do not wrap an rgc model in DistributedDataParallel: DDP all-reduces a d x k buffer of zeros "
    "for every compressed weight and never averages the sketches, so ranks drift apart. Use "
    "rgc.distributed.DistributedRGCOptimizer (or call rgc.distributed.all_reduce_sketches(model) "
    "between backward and step) on the bare model instead.")


def _is_active(group) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _params_of(obj) -> list[torch.Tensor]:
    if isinstance(obj, Optimizer):
        return [p for g in obj.param_groups for p in g["params"]]
    if isinstance(obj, nn.parallel.DistributedDataParallel):
        raise TypeError(_DDP_HINT)
    if isinstance(obj, nn.Module):
        return list(obj.parameters())
    raise TypeError(f"expected an nn.Module or an optimizer, got {type(obj).__name__}")


def _fingerprint(obj) -> list[int]:
    """One integer per field of ``_FINGERPRINT_FIELDS``, each in [0, 2**63)."""
    params = _params_of(obj)
    layers = [(i, sketched_owner_of(p)) for i, p in enumerate(params)]
    layers = [(i, layer) for i, layer in layers if layer is not None]
    shapes = derive_seed(len(params), *[x for p in params for x in (p.dim(), *p.shape)])
    seeds = derive_seed(len(layers), *[x for i, layer in layers for x in (i, layer.seed)])
    versions = derive_seed(len(layers), *[layer.projection_version for _, layer in layers])
    config = derive_seed(len(layers), *[x for _, layer in layers for x in (
        layer.rank, layer.projection_kind, str(layer.refresh))])
    rounding = 0
    if isinstance(obj, Optimizer):
        steps = [int(obj.state[p].get("step", 0)) if p in obj.state else 0 for p in params]
        rounding = derive_seed(len(obj.param_groups),
                               *[int(g.get("seed", 0)) for g in obj.param_groups], *steps)
    return [shapes, seeds, versions, config, rounding]


def check_seeds(model_or_optimizer, *, group=None) -> None:
    """Raise ``RuntimeError`` unless every rank of ``group`` has the same seeds.

    Compares, with one all-gather of five int64 per rank, the parameter shapes, every
    CompressedLinear's projection seed, version, rank, kind and refresh schedule, and (given an
    optimizer) the rounding seeds: each param group's ``seed`` and each parameter's step count.
    A no-op without an initialised process group of more than one rank.
    """
    params = _params_of(model_or_optimizer)
    if group is None:
        group = next((p.device_mesh.get_group() for p in params if isinstance(p, DTensor)), None)
    if not _is_active(group):
        return
    device = _local(params[0]).device if params else torch.device("cpu")
    mine = torch.tensor(_fingerprint(model_or_optimizer), dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).cpu().tolist()
    differ = [(name, [row[j] for row in rows]) for j, name in enumerate(_FINGERPRINT_FIELDS)
              if len({row[j] for row in rows}) > 1]
    if differ:
        details = "; ".join(f"{name}: digest per rank {[f'{v:016x}'[:8] for v in values]}"
                            for name, values in differ)
        raise RuntimeError(
            f"rgc: ranks disagree on {details}. Every rank must build the same model, call "
            "rgc.wrap(model, rank, seed=...) with the same seed, load the same checkpoint, and "
            "build the optimizer with the same seed; otherwise the averaged sketches belong to "
            "different projections and the weights diverge.")


@dataclass
class _Slot:
    """One tensor to reduce: its current value (``None``: absent on this rank) and a setter."""

    tensor: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    assign: Callable[[torch.Tensor | None], None]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _buckets(slots: list[_Slot], bucket_bytes: int) -> list[list[_Slot]]:
    """The slots grouped by (dtype, device), in order, cut into runs of at most ``bucket_bytes``
    (a single larger slot gets a bucket of its own)."""
    by_kind: dict[tuple, list[_Slot]] = {}
    for slot in slots:
        by_kind.setdefault((slot.dtype, slot.device), []).append(slot)
    buckets = []
    for kind_slots in by_kind.values():
        current, size = [], 0
        for slot in kind_slots:
            nbytes = slot.numel * slot.dtype.itemsize
            if current and size + nbytes > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(slot)
            size += nbytes
        buckets.append(current)
    return buckets


def _store(slot: _Slot, value: torch.Tensor | None) -> None:
    """Write the reduced value back, into the existing tensor when there is one."""
    if value is None or slot.tensor is None:
        slot.assign(None if value is None else value.clone())
    else:
        slot.tensor.copy_(value)


def _all_reduce_mean(slots: list[_Slot], group, bucket_bytes: int) -> int:
    """Average the slots over the ranks of ``group``; returns the bytes sent per rank.

    Each bucket is ``[presence flags (one per slot) | values]`` in the slots' dtype, summed in one
    all-reduce; a slot absent on every rank stays absent, one absent on some ranks counts as zero
    there (as DDP does), and the sum is divided by the world size.
    """
    world = dist.get_world_size(group)
    sent = 0
    for bucket in _buckets(slots, bucket_bytes):
        n = len(bucket)
        flat = torch.zeros(n + sum(s.numel for s in bucket), dtype=bucket[0].dtype,
                           device=bucket[0].device)
        offset = n
        for j, slot in enumerate(bucket):
            if slot.tensor is not None:
                flat[j] = 1
                flat[offset:offset + slot.numel].copy_(slot.tensor.reshape(-1))
            offset += slot.numel
        dist.all_reduce(flat, group=group)
        sent += flat.numel() * flat.element_size()
        present = flat[:n].ne(0).tolist()
        offset = n
        for slot, here in zip(bucket, present, strict=True):
            value = flat[offset:offset + slot.numel].view(slot.shape).div_(world)
            _store(slot, value if here else None)
            offset += slot.numel
    return sent


def _sketch_slot(layer) -> _Slot:
    return _Slot(layer.sketch, tuple(layer.sketch_shape), torch.float32,
                 layer.weight.device, lambda t: setattr(layer, "sketch", t))


def _grad_slot(p: torch.Tensor) -> _Slot:
    return _Slot(p.grad, tuple(p.shape), p.dtype, p.device, lambda t: setattr(p, "grad", t))


def _replicated_slots(params: list[torch.Tensor]) -> list[_Slot]:
    slots = []
    for p in params:
        if isinstance(p, DTensor) or not p.requires_grad:
            continue
        layer = sketched_owner_of(p)
        if layer is None:
            slots.append(_grad_slot(p))
            continue
        if p.grad is not None and layer.sketch is not None:
            raise RuntimeError(
                "a compressed weight has a dense .grad as well as a sketch, which happens when the "
                f"model is wrapped in DistributedDataParallel. {_DDP_HINT}")
        slots.append(_sketch_slot(layer))
    return slots


_VERIFIED: weakref.WeakSet = weakref.WeakSet()


def all_reduce_sketches(model_or_optimizer, *, group=None,
                        bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Average sketches and gradients over the ranks of ``group``; call between backward and step.

    For every trainable parameter of ``model_or_optimizer`` (a module, or an optimizer's param
    groups) that is not a DTensor: a CompressedLinear weight contributes its sketch (d x r FP32),
    any other parameter its ``.grad``. They are flattened into buckets of at most ``bucket_mb``
    MiB per dtype (not one collective per layer), all-reduced in a fixed order, and divided by
    the world size, so every rank ends with the same bits. The first call for an object runs
    :func:`check_seeds` on it. :class:`DistributedRGCOptimizer` calls this in ``step()``; the
    function is for pairing an rgc model with another optimizer.

    Do not also wrap the model in ``DistributedDataParallel``. A compressed weight never gets a
    gradient from autograd, yet DDP still all-reduces a d x k buffer for it (zeros; with
    ``find_unused_parameters=False`` it also allocates a d x k zero ``.grad``), and DDP never sees
    the sketches, so without this call every rank would apply its own. Passing a DDP module, or
    finding a compressed weight with both a sketch and a ``.grad``, raises.

    Returns the bytes this rank passed to all-reduce (sketches, gradients and one presence flag
    per tensor); 0 without an initialised process group of more than one rank.
    """
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb must be > 0, got {bucket_mb!r}")
    params = _params_of(model_or_optimizer)
    if not _is_active(group):
        return 0
    if model_or_optimizer not in _VERIFIED:
        check_seeds(model_or_optimizer, group=group)
        _VERIFIED.add(model_or_optimizer)
    slots = _replicated_slots(params)
    return _all_reduce_mean(slots, group, int(bucket_mb * 2**20))


def _row_range(p: DTensor) -> tuple[int, int]:
    """First global row and row count of this rank's ``Shard(0)`` piece (``torch.chunk`` rule)."""
    mesh = p.device_mesh
    world, rank = mesh.size(), mesh.get_local_rank()
    chunk = -(-p.shape[0] // world)
    start = min(rank * chunk, p.shape[0])
    rows = min(chunk, p.shape[0] - start)
    if p.to_local().shape[0] != rows:
        raise RuntimeError(f"unexpected local shard of {tuple(p.shape)}: {rows} rows expected at "
                           f"row {start}, got {p.to_local().shape[0]}")
    return start, rows


def _check_sharded(p: DTensor) -> None:
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise NotImplementedError(
            f"rgc supports DTensor parameters sharded by rows on a 1-D mesh (FSDP2's default "
            f"Shard(0)); got placements {tuple(p.placements)} on a {p.device_mesh.ndim}-D mesh")


def _reduce_scatter_rows(items: list[tuple[DTensor, object]], group,
                         bucket_bytes: int) -> tuple[dict[int, torch.Tensor], int]:
    """Sum the sketches over ranks and keep this rank's rows, divided by the world size.

    Returns ``{id(param): local sketch rows}`` for the layers with a sketch on some rank, and
    the bytes this rank passed to reduce-scatter. Each bucket is a (world x width) FP32 matrix
    whose row i holds, per layer, a presence flag and the ``ceil(d / world)`` sketch rows owned by
    rank i (zero padded, like FSDP2's own padding).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    slots = [_sketch_slot(layer) for _, layer in items]
    owner = {id(slot): p for slot, (p, _) in zip(slots, items, strict=True)}
    local, sent = {}, 0
    for bucket in _buckets(slots, bucket_bytes):
        n = len(bucket)
        chunks = [-(-s.shape[0] // world) for s in bucket]
        width = n + sum(c * s.shape[1] for c, s in zip(chunks, bucket, strict=True))
        inp = torch.zeros(world, width, dtype=torch.float32, device=bucket[0].device)
        offset = n
        for j, (slot, chunk) in enumerate(zip(bucket, chunks, strict=True)):
            d, r = slot.shape
            if slot.tensor is not None:
                inp[:, j] = 1
                padded = F.pad(slot.tensor, (0, 0, 0, world * chunk - d))
                inp[:, offset:offset + chunk * r] = padded.view(world, chunk * r)
            offset += chunk * r
        out = torch.empty(width, dtype=torch.float32, device=inp.device)
        reduce_scatter(out, inp.view(-1), group=group)
        sent += inp.numel() * inp.element_size()
        present = out[:n].ne(0).tolist()
        offset = n
        for slot, chunk, here in zip(bucket, chunks, present, strict=True):
            d, r = slot.shape
            rows = max(0, min(chunk, d - rank * chunk))
            if here:
                local[id(owner[id(slot)])] = out[offset:offset + rows * r].view(rows, r) / world
            offset += chunk * r
    return local, sent


class DistributedRGCOptimizer(RGCOptimizer):
    """:class:`rgc.RGCOptimizer` for data parallel and FSDP2 training on ``torch.distributed``.

    Same update, arguments and state as ``RGCOptimizer``; ``step()`` first communicates:

    * parameters that are plain tensors (data parallel, every rank holds them whole): sketches
      of compressed weights (d x r FP32) and gradients of the others are averaged over
      ``group`` with :func:`all_reduce_sketches` (bucketed, fixed order), then updated as by
      ``RGCOptimizer``. All ranks end bit-identical.
    * ``Shard(0)`` DTensor parameters (FSDP2's ``fully_shard`` after ``rgc.wrap``): the sketches
      are reduce-scattered so that each rank holds the ``C`` rows of the weight rows it owns; the
      squared norms ``||W||^2``, ``||H||^2 = sum((C G) * C)`` with ``G = P^T P`` (r x r), and a
      non-finite count are summed with one all-reduce of three FP32 scalars per parameter; each
      rank then updates its rows through ``rgc.ops.lowrank_update_`` with rounding offset
      ``first_row * k``, exactly the bits those rows get in the unsharded update. No rank forms
      more than ``chunk_rows x k`` of ``H`` (the kernel path none at all), nor a d x k gradient.
      Other trainable DTensor parameters use FSDP's averaged ``.grad`` with the same
      normalised rule, computed on the local shard with all-reduced norms.

    Construction runs :func:`check_seeds` (one all-gather of a few int64) on the optimizer.

    Args:
        params, lr, chunk_rows, stochastic_rounding, seed, maximize: as
            :class:`rgc.RGCOptimizer`
            (``step_control`` and ``keep_updates`` are not supported here and raise).
        group: process group for the plain-tensor parameters (default: the whole world); the
            sharded ones use their device mesh's group.
        bucket_mb: largest bucket of one collective, in MiB.

    ``last_comm_bytes`` holds the bytes this rank passed to the collectives in the last step.
    """

    def __init__(self, params, lr: float | torch.Tensor = 1e-3, *, group=None,
                 bucket_mb: float = DEFAULT_BUCKET_MB, **kwargs):
        for unsupported in ("step_control", "keep_updates"):
            if kwargs.get(unsupported):
                raise NotImplementedError(
                    f"DistributedRGCOptimizer does not support {unsupported}= yet; use "
                    "all_reduce_sketches() with a single-process rgc optimizer instead")
        super().__init__(params, lr, **kwargs)
        if not isinstance(bucket_mb, (int, float)) or not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be a number > 0, got {bucket_mb!r}")
        self._group = group
        self._bucket_bytes = int(bucket_mb * 2**20)
        sharded = [p for p in _params_of(self) if isinstance(p, DTensor)]
        for p in sharded:
            _check_sharded(p)
            owner = sketched_owner_of(p)
            if owner is not None and owner.num_matrices > 1:
                raise NotImplementedError(
                    f"a sketched stack of {owner.num_matrices} experts is sharded by FSDP2 "
                    "(fully_shard); DistributedRGCOptimizer updates expert stacks under data "
                    "parallel only: leave the experts modules out of fully_shard, or train "
                    "them on one process")
        if any(p.device_mesh != sharded[0].device_mesh for p in sharded):
            raise NotImplementedError("all sharded parameters must share one device mesh")
        self._mesh_group = sharded[0].device_mesh.get_group() if sharded else None
        self.last_comm_bytes = 0
        check_seeds(self, group=self._mesh_group if sharded else group)

    def _init_state(self, p, layer):
        # Always with the layer's seed and version: torch.distributed.checkpoint builds its load
        # template from a step with zero dense gradients, and loads only the keys it finds there.
        return super()._init_state(p, layer if layer is not None else sketched_owner_of(p))

    @torch.no_grad()
    def step(self, closure=None):
        """Average (or reduce-scatter) sketches and gradients, then update. Returns the loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = [p for g in self.param_groups for p in g["params"]]
        self.last_comm_bytes = 0
        if _is_active(self._group):
            self.last_comm_bytes += _all_reduce_mean(_replicated_slots(params), self._group,
                                                     self._bucket_bytes)
        entries = [(i, p, g) for i, (p, g) in enumerate(
            (p, g) for g in self.param_groups for p in g["params"])]
        sharded = [(i, p, g) for i, p, g in entries if isinstance(p, DTensor) and p.requires_grad]
        stacks, dense = self._gather(exclude=lambda p: isinstance(p, DTensor))
        finished = self._step_sharded(sharded) if sharded else []
        self._step_entries((stacks, dense), None, None)
        self._finish([finished])
        self.steps_taken += 1
        return loss

    def _step_sharded(self, entries: list) -> list[Entry]:
        """Update the local rows of every sharded parameter; returns the compressed ones'
        entries, to be finished (sketch cleared, projection refreshed) with the others."""
        compressed = [(p, compressed_layer_of(p)) for _, p, _ in entries]
        compressed = [(p, layer) for p, layer in compressed if layer is not None]
        local, sent = _reduce_scatter_rows(compressed, self._mesh_group, self._bucket_bytes)
        self.last_comm_bytes += sent
        work, sums = [], []
        for index, p, group in entries:
            layer = compressed_layer_of(p)
            start, rows = _row_range(p)
            w_local = p.to_local()
            if layer is not None and id(p) in local:
                c_local = local[id(p)]
                proj = layer.projection.to(torch.float32)
                h2 = ((c_local @ (proj.t() @ proj)) * c_local).sum()
                bad = (~torch.isfinite(c_local)).sum()
                work.append((index, p, group, layer, c_local, start))
            elif p.grad is not None:
                g_local = p.grad.to_local()
                h2 = g_local.to(torch.float32).square().sum()
                bad = (~torch.isfinite(g_local)).sum()
                work.append((index, p, group, None, g_local, start))
            else:
                continue
            w_sq = sum_squares(w_local, chunk_rows=group["chunk_rows"])
            sums.append(torch.stack([w_sq, h2, bad.to(torch.float32)]))
        if not work:
            return []
        totals = torch.stack(sums)
        dist.all_reduce(totals, group=self._mesh_group)
        self.last_comm_bytes += totals.numel() * totals.element_size()
        finished = []
        for row, (index, p, group, layer, local_value, start) in enumerate(work):
            state = self._init_state(p, layer)
            state["step"] += 1
            ok = totals[row, 2] == 0
            state["skipped"] += ~ok
            coef, _ = normalized_coef(totals[row, 0], totals[row, 1],
                                      group_lr(group, totals.device), ok)
            if group["maximize"]:
                coef = -coef
            seed = rounding_seed(group["seed"], index, int(state["step"]))
            w_local = p.to_local()
            row_len = w_local[0].numel() if w_local.dim() > 1 else 1
            if layer is not None:
                if w_local.shape[0]:
                    apply_lowrank_update_(
                        w_local, local_value, layer.projection, coef, seed=seed,
                        offset=start * row_len, chunk_rows=group["chunk_rows"],
                        stochastic_rounding=group["stochastic_rounding"])
                finished.append(Entry(p, layer, group, state, seed))
            else:
                apply_dense_update_(w_local, local_value, coef, seed=seed,
                                    offset=start * row_len,
                                    stochastic_rounding=group["stochastic_rounding"])
        return finished
