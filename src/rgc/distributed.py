"""Multi-process training on ``torch.distributed``: data parallel and FSDP2, for every rule.

What crosses the network is the d x r FP32 sketch ``C`` of each compressed weight, never its
d x k gradient. Because ``C = G P`` is linear in the gradient, averaging sketches equals
sketching the averaged gradient: the reduction is exact, with no error feedback.

Data parallel (every rank holds the whole model; ``torchrun`` starts one process per device)::

    model = rgc.wrap(model, rank=64, seed=0)          # the same seed on every rank
    opt = rgc.DistributedRGCOptimizer(model.parameters(), lr=tau)   # or DistributedRowAdam
    loss.backward()                                   # loss on this rank's share of the batch
    opt.step()                                        # averages sketches and grads, then updates
    opt.zero_grad()

Do not wrap the model in ``DistributedDataParallel``: see :func:`all_reduce_sketches`.

FSDP2: ``rgc.wrap`` first, then ``torch.distributed.fsdp.fully_shard`` (weights become
``Shard(0)`` DTensors). The same optimizer reduce-scatters each sketch to the rows a rank owns
and runs the rule on those rows only; the sums the rule's coefficients need (``||W||^2``,
``||H||^2``, non-finite counts) are summed over the ranks with one all-reduce per step, and the
rows are written with the rounding bits they have in the unsharded weight. Other trainable
parameters get FSDP's usual reduce-scattered gradients.

:class:`DataParallel` and :class:`FSDP2` are that communication, and nothing else: two
communication strategies (:mod:`rgc.optim.comm`) of the one step pipeline, whose update rule,
state and bookkeeping are the single-process optimizer's (``DistributedRGCOptimizer`` is
:class:`rgc.RGCOptimizer` with the strategy its parameters need, ``DistributedRowAdam``
:class:`rgc.RowAdam`). The optimizer checks at construction, with one all-gather of a few
integers, that every rank has the same projection seeds and versions and the same rounding
seeds.
"""

from __future__ import annotations

import dataclasses
import math
import weakref
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.optim import Optimizer

from rgc.optim.base import Entry
from rgc.optim.comm import Local
from rgc.optim.rgc import RGCOptimizer
from rgc.optim.rowadam import RowAdam
from rgc.optim.rules import Partials
from rgc.payload import FINGERPRINT_MODULUS, KeptUpdate, fingerprint_tensor
from rgc.registry import sketched_owner_of
from rgc.seeding import derive_seed
from rgc.updates import DenseUpdate, LowRankUpdate, StackUpdate

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # torch < 2.5
    from torch.distributed._tensor import DTensor, Shard

__all__ = ["DataParallel", "DistributedRGCOptimizer", "DistributedRowAdam", "ExpertShard", "FSDP2",
           "all_reduce_sketches", "check_seeds", "communication"]

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
    "rgc.DistributedRGCOptimizer or rgc.DistributedRowAdam (or call "
    "rgc.distributed.all_reduce_sketches(model) between backward and step) on the bare model "
    "instead.")


def _check_bucket_mb(bucket_mb) -> None:
    if (isinstance(bucket_mb, bool) or not isinstance(bucket_mb, (int, float))
            or not bucket_mb > 0):
        raise ValueError(f"bucket_mb must be a number > 0 (MiB), got {bucket_mb!r}")


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


@dataclass
class _Pending:
    """A bucket whose collective has run: its received presence flags (one per slot, read on
    the host together with every other bucket's) and what to do with them."""

    flags: torch.Tensor
    settle: Callable[[list[bool]], None]


def _settle(pending: list[_Pending]) -> None:
    """Read the presence flags of every bucket with one host copy, then unpack the buckets."""
    if not pending:
        return
    present = torch.cat([p.flags.ne(0) for p in pending]).tolist()
    start = 0
    for p in pending:
        p.settle(present[start:start + p.flags.numel()])
        start += p.flags.numel()


def _buckets(slots: list, bucket_bytes: int, nbytes: Callable,
             kind: Callable = lambda s: (s.dtype, s.device)) -> list[list]:
    """The slots grouped by ``kind`` (default: dtype and device), in order, cut into runs of at
    most ``bucket_bytes`` (``nbytes(slot)`` each; a single larger slot gets a bucket of its
    own)."""
    by_kind: dict[tuple, list] = {}
    for slot in slots:
        by_kind.setdefault(kind(slot), []).append(slot)
    buckets = []
    for kind_slots in by_kind.values():
        current, size = [], 0
        for slot in kind_slots:
            if current and size + nbytes(slot) > bucket_bytes:
                buckets.append(current)
                current, size = [], 0
            current.append(slot)
            size += nbytes(slot)
        buckets.append(current)
    return buckets


def _store(slot: _Slot, value: torch.Tensor | None) -> None:
    """Write the reduced value back, into the existing tensor when there is one."""
    if value is None or slot.tensor is None:
        slot.assign(None if value is None else value.clone())
    else:
        slot.tensor.copy_(value)


def _all_reduce_mean(slots: list[_Slot], group, bucket_bytes: int) -> tuple[list[_Pending], int]:
    """Average the slots over the ranks of ``group``: the issued buckets (settle them with
    :func:`_settle`) and the bytes sent per rank.

    Each bucket is ``[presence flags (one per slot) | values]`` in the slots' dtype, summed in one
    all-reduce; a slot absent on every rank stays absent, one absent on some ranks counts as zero
    there (as DDP does), and the sum is divided by the world size.
    """
    world = dist.get_world_size(group)
    pending, sent = [], 0
    for bucket in _buckets(slots, bucket_bytes, lambda s: s.numel * s.dtype.itemsize):
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

        def settle(present, bucket=bucket, flat=flat, n=n):
            offset = n
            for slot, here in zip(bucket, present, strict=True):
                value = flat[offset:offset + slot.numel].view(slot.shape).div_(world)
                _store(slot, value if here else None)
                offset += slot.numel

        pending.append(_Pending(flat[:n], settle))
    return pending, sent


def _sketch_slot(layer) -> _Slot:
    return _Slot(layer.sketch, tuple(layer.sketch_shape), torch.float32,
                 layer.projection.device, lambda t: setattr(layer, "sketch", t))


def _grad_slot(p: torch.Tensor) -> _Slot:
    return _Slot(p.grad, tuple(p.shape), p.dtype, p.device, lambda t: setattr(p, "grad", t))


def _check_no_dense_grad(p: torch.Tensor, owner) -> None:
    """A sketched weight's ``.grad``: refused beside a sketch (DDP), or, all zeros (what
    ``torch.distributed.checkpoint`` sets to build its load template), taken as a zero sketch."""
    if p.grad is None:
        return
    if owner.sketch is not None:
        raise RuntimeError(
            "a compressed weight has a dense .grad as well as a sketch, which happens when the "
            f"model is wrapped in DistributedDataParallel. {_DDP_HINT}")
    grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
    if bool(grad.any()):  # a host read, on this path only
        raise RuntimeError(
            f"a sketched weight {tuple(p.shape)} has a non-zero dense .grad: rgc trains it from "
            "its sketch only. Something other than its forward computed with it (or wrote its "
            ".grad); leave the weight to rgc, or rgc.unwrap(model) to train it densely")
    owner.sketch = torch.zeros(owner.sketch_shape, dtype=torch.float32, device=grad.device)
    p.grad = None


def _replicated_slots(params: list[torch.Tensor]) -> list[_Slot]:
    slots = []
    for p in params:
        if isinstance(p, DTensor) or not p.requires_grad:
            continue
        layer = sketched_owner_of(p)
        if layer is None:
            slots.append(_grad_slot(p))
            continue
        _check_no_dense_grad(p, layer)
        slots.append(_sketch_slot(layer))
    return slots


_VERIFIED: weakref.WeakSet = weakref.WeakSet()


def all_reduce_sketches(model_or_optimizer, *, group=None,
                        bucket_mb: float = DEFAULT_BUCKET_MB) -> int:
    """Average sketches and gradients over the ranks of ``group``; call between backward and step.

    For every trainable parameter of ``model_or_optimizer`` (a module, or an optimizer's param
    groups) that is not a DTensor: a sketched weight contributes its sketch (d x r FP32, or
    E x d x r for a stack of experts), any other parameter its ``.grad``. They are flattened into
    buckets of at most ``bucket_mb`` MiB per dtype (not one collective per layer), all-reduced in
    a fixed order, and divided by the world size, so every rank ends with the same bits. The
    presence flags of all buckets are read with one host copy. The first call for an object runs
    :func:`check_seeds` on it. The distributed optimizers call this in ``step()``; the function
    is for pairing an rgc model with another optimizer.

    Do not also wrap the model in ``DistributedDataParallel``. A compressed weight never gets a
    gradient from autograd, yet DDP still all-reduces a d x k buffer for it (zeros; with
    ``find_unused_parameters=False`` it also allocates a d x k zero ``.grad``), and DDP never sees
    the sketches, so without this call every rank would apply its own. Passing a DDP module, or
    finding a compressed weight with both a sketch and a ``.grad``, raises.

    Returns the bytes this rank passed to all-reduce (sketches, gradients and one presence flag
    per tensor); 0 without an initialised process group of more than one rank.
    """
    _check_bucket_mb(bucket_mb)
    params = _params_of(model_or_optimizer)
    if not _is_active(group):
        return 0
    if model_or_optimizer not in _VERIFIED:
        check_seeds(model_or_optimizer, group=group)
        _VERIFIED.add(model_or_optimizer)
    pending, sent = _all_reduce_mean(_replicated_slots(params), group, int(bucket_mb * 2**20))
    _settle(pending)
    return sent


# ------------------------------------------------------------------------- row shards

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
    _check_not_offloaded(p)


def _check_not_offloaded(p) -> None:
    """Refuse a shard kept off its mesh's device (FSDP2's ``CPUOffloadPolicy``)."""
    if p.device.type != p.device_mesh.device_type:
        raise NotImplementedError(
            f"a sharded parameter {tuple(p.shape)} lives on {p.device.type} while its device "
            f"mesh computes on {p.device_mesh.device_type}: FSDP2's CPUOffloadPolicy, which "
            "rgc's step does not serve (the sketches are reduced and the updates written on "
            "the mesh's device). Shard without offload_policy: a compressed weight has no "
            "dense gradient and its optimizer state is sketch-sized, so offloading would only "
            "move the weight shards themselves")


class RowShard:
    """The rows ``[first_row, first_row + rows)`` of a sketched 2-D weight that this rank holds
    (a ``Shard(0)`` DTensor), seen through the owner interface (:class:`rgc.sketched.
    SketchedWeight`): ``weight_matrices()`` is ``[1, rows, k]`` (a view of the local shard),
    ``sketch_matrices()`` ``[1, rows, r]`` (the reduce-scattered, averaged rows), and
    ``out_features`` is ``rows``. Everything else (projection, seeds, version, refresh, the
    whole sketch) is the owner's, reads and writes alike, so the rule's projection refresh and
    bookkeeping act on the owner."""

    num_matrices = 1

    def __init__(self, owner, weight_rows: torch.Tensor, sketch_rows: torch.Tensor,
                 first_row: int):
        vars(self).update(owner=owner, weight_rows=weight_rows, sketch_rows=sketch_rows,
                          first_row=first_row, out_features=weight_rows.shape[0])

    @property
    def sketch_shape(self) -> tuple[int, int]:
        return tuple(self.sketch_rows.shape)

    def weight_matrices(self) -> torch.Tensor:
        return self.weight_rows.unsqueeze(0)

    def sketch_matrices(self) -> torch.Tensor:
        return self.sketch_rows.unsqueeze(0)

    def __getattr__(self, name):
        return getattr(vars(self)["owner"], name)

    def __setattr__(self, name, value):
        setattr(self.owner, name, value)


class ExpertShard(RowShard):
    """The experts ``[first_row, first_row + n)`` of a sketched stack of E experts that this
    rank holds whole (FSDP2's ``Shard(0)`` of an ``[E, d, k]`` weight), seen through the owner
    interface: ``weight_matrices()`` is ``[n, d, k]`` (a view of the local shard),
    ``sketch_matrices()`` ``[n, d, r]`` (the reduce-scattered, averaged sketches of those
    experts), ``num_matrices`` is ``n`` and ``total_matrices`` E; the rest is the owner's, as
    for :class:`RowShard`."""

    def __init__(self, owner, weights: torch.Tensor, sketches: torch.Tensor, first_row: int):
        vars(self).update(owner=owner, weights=weights, sketch_rows=sketches,
                          first_row=first_row, num_matrices=weights.shape[0],
                          total_matrices=owner.num_matrices)

    def weight_matrices(self) -> torch.Tensor:
        return self.weights

    def sketch_matrices(self) -> torch.Tensor:
        return self.sketch_rows


class LocalState(MutableMapping):
    """The optimizer state of a ``Shard(0)`` parameter as this rank's rows.

    A state tensor whose first dimension is the parameter's local row count (RowAdam's moments:
    ``rows x r``, ``rows``; a dense parameter's elementwise moments) is stored as a ``Shard(0)``
    DTensor on the parameter's mesh, so that ``torch.distributed.checkpoint`` saves and reshards
    it like FSDP's own state, and reads as its local rows (a view: in-place updates stay in
    it). Anything else (step counts, 0-dim counters) is stored as it is.
    """

    def __init__(self, state: dict, param: DTensor):
        self._state, self._param = state, param
        self._rows = param.to_local().shape[0]

    def __getitem__(self, key):
        value = self._state[key]
        return value.to_local() if isinstance(value, DTensor) else value

    def __setitem__(self, key, value):
        if (torch.is_tensor(value) and not isinstance(value, DTensor) and value.dim() >= 1
                and value.shape[0] == self._rows):
            shape = (self._param.shape[0], *value.shape[1:])
            value = DTensor.from_local(value.contiguous(), self._param.device_mesh, [Shard(0)],
                                       run_check=False, shape=shape,
                                       stride=torch.empty(shape, device="meta").stride())
        self._state[key] = value

    def __delitem__(self, key):
        del self._state[key]

    def __iter__(self):
        return iter(self._state)

    def __len__(self) -> int:
        return len(self._state)


@dataclass
class ShardEntry(Entry):
    """An :class:`rgc.optim.base.Entry` of this rank's rows of a ``Shard(0)`` parameter:
    ``param`` is a view of the local rows (with the local ``.grad`` for a dense parameter),
    ``owner`` a :class:`RowShard`, ``state`` a :class:`LocalState`; ``whole`` is the DTensor
    parameter."""

    whole: DTensor | None = None


@dataclass
class _ShardRecord:
    """A kept update of a row shard: the local update, the entry, this rank's share of the
    fingerprint of the whole parameter before the update, and the projection seed used."""

    update: LowRankUpdate | DenseUpdate
    entry: ShardEntry
    base_share: torch.Tensor
    projection_seed: int | None


def _reduce_scatter_rows(items: list[tuple[DTensor, object]], group, bucket_bytes: int,
                         local: dict) -> tuple[list[_Pending], int]:
    """Sum the sketches over ranks and keep this rank's rows, divided by the world size.

    Settling the returned buckets puts ``local[id(param)]`` = the local sketch rows for every
    layer with a sketch on some rank (a layer with a sketch elsewhere only gets a zero sketch
    here, so that it takes the step); the bytes this rank passed to reduce-scatter are returned.
    Each bucket is a (world x width) FP32 matrix whose row i holds, per layer, a presence flag
    and the ``ceil(d / world)`` sketch rows owned by rank i (zero padded, like FSDP2's own
    padding). A "row" is the sketch's first dimension: a d x r sketch's row, or an expert's
    ``d x r`` sketch in an ``E x d x r`` stack (FSDP2 shards a stack over experts).
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    slots = [_sketch_slot(layer) for _, layer in items]
    owner_of = {id(slot): item for slot, item in zip(slots, items, strict=True)}
    pending, sent = [], 0
    for bucket in _buckets(slots, bucket_bytes, lambda s: s.numel * 4):
        n = len(bucket)
        chunks = [-(-s.shape[0] // world) for s in bucket]
        width = n + sum(c * math.prod(s.shape[1:]) for c, s in zip(chunks, bucket, strict=True))
        inp = torch.zeros(world, width, dtype=torch.float32, device=bucket[0].device)
        offset = n
        for j, (slot, chunk) in enumerate(zip(bucket, chunks, strict=True)):
            d, r = slot.shape[0], math.prod(slot.shape[1:])
            if slot.tensor is not None:
                inp[:, j] = 1
                padded = F.pad(slot.tensor.reshape(d, r), (0, 0, 0, world * chunk - d))
                inp[:, offset:offset + chunk * r] = padded.view(world, chunk * r)
            offset += chunk * r
        out = torch.empty(width, dtype=torch.float32, device=inp.device)
        reduce_scatter(out, inp.view(-1), group=group)
        sent += inp.numel() * inp.element_size()

        def settle(present, bucket=bucket, chunks=chunks, out=out, n=n):
            offset = n
            for slot, chunk, here in zip(bucket, chunks, present, strict=True):
                d, r = slot.shape[0], math.prod(slot.shape[1:])
                rows = max(0, min(chunk, d - rank * chunk))
                p, layer = owner_of[id(slot)]
                if here:
                    local[id(p)] = out[offset:offset + rows * r].view(
                        rows, *slot.shape[1:]).div_(world)
                    if layer.sketch is None:
                        layer.sketch = torch.zeros(slot.shape, dtype=torch.float32,
                                                   device=out.device)
                offset += chunk * r

        pending.append(_Pending(out[:n], settle))
    return pending, sent


def _all_gather_rows(items: list[tuple[torch.Tensor, int]], group, bucket_bytes: int
                     ) -> tuple[list[torch.Tensor], int]:
    """The whole ``d x c`` FP32 tensors of ``Shard(0)`` row shards: ``items`` are
    ``(local rows x c, d)``, the same list (in the same order) on every rank. Bucketed
    all-gathers of the local rows, each padded to ``ceil(d / world)``; returns the tensors and
    the bytes this rank sent."""
    world = dist.get_world_size(group)
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    chunks = [-(-d // world) * t.shape[1] for t, d in items]
    whole: list[torch.Tensor | None] = [None] * len(items)
    sent = 0
    for bucket in _buckets(list(range(len(items))), bucket_bytes, lambda i: chunks[i] * 4,
                           lambda i: items[i][0].device):
        width = sum(chunks[i] for i in bucket)
        device = items[bucket[0]][0].device
        inp = torch.zeros(width, dtype=torch.float32, device=device)
        offset = 0
        for i in bucket:
            t = items[i][0]
            inp[offset:offset + t.numel()].copy_(t.reshape(-1))
            offset += chunks[i]
        out = torch.empty(world * width, dtype=torch.float32, device=device)
        all_gather(out, inp, group=group)
        sent += inp.numel() * inp.element_size()
        rows = out.view(world, width)
        offset = 0
        for i in bucket:
            t, d = items[i]
            c = t.shape[1]
            whole[i] = rows[:, offset:offset + chunks[i]].reshape(-1, c)[:d]
            offset += chunks[i]
    return whole, sent


# ------------------------------------------------------------------------ the strategies

class DataParallel(Local):
    """The communication of a step when every rank holds every parameter whole.

    The sketches of sketched weights (d x r FP32, ``E x d x r`` for a stack of experts) and the
    gradients of the other trainable parameters are averaged over ``group`` before the rule
    runs (bucketed all-reduces in a fixed order, see :func:`all_reduce_sketches`); every rank
    then runs the rule on the same bits, and a step controller sums its probe statistics over
    the ranks with :meth:`sum_over_ranks`. ``group``: the process group (default: the whole
    world); ``bucket_mb``: the largest bucket of one collective, in MiB. Without an
    initialised process group of more than one rank it exchanges nothing.

    Attached to an optimizer (``comm=``), it runs :func:`check_seeds` on it (one all-gather of
    a few int64). ``last_comm_bytes`` holds the bytes this rank passed to collectives in the
    last step, ``last_export_bytes`` those of the last ``export_update()``.
    """

    exchanges = True

    def __init__(self, group=None, bucket_mb: float = DEFAULT_BUCKET_MB):
        _check_bucket_mb(bucket_mb)
        self.group = group
        self.bucket_bytes = int(bucket_mb * 2**20)
        self.last_comm_bytes = 0
        self.last_export_bytes = 0

    @property
    def train_group(self):
        """The group the model trains over."""
        return self.group

    def attach(self, optimizer) -> None:
        sharded = [p for p in _params_of(optimizer) if isinstance(p, DTensor)]
        if sharded:
            raise ValueError(
                f"{len(sharded)} parameter(s) are DTensors (sharded, e.g. by FSDP2's "
                "fully_shard), which the DataParallel strategy does not serve: use "
                "rgc.distributed.FSDP2 (rgc.DistributedRGCOptimizer / DistributedRowAdam "
                "pick it for you)")
        check_seeds(optimizer, group=self.train_group)

    def _issue(self, params: list[torch.Tensor], local: dict) -> list[_Pending]:
        """Start the collectives of a step: the replicated sketches' and gradients' mean."""
        for p in params:
            owner = sketched_owner_of(p)
            if owner is not None:
                _check_no_dense_grad(p, owner)
        if not _is_active(self.group):
            return []
        pending, sent = _all_reduce_mean(_replicated_slots(params), self.group,
                                         self.bucket_bytes)
        self.last_comm_bytes += sent
        return pending

    def exchange(self, params: list[torch.Tensor]) -> dict:
        """Run the step's collectives (the presence flags of all buckets read with one host
        copy); returns this rank's sketch rows of sharded weights (none here)."""
        self.last_comm_bytes = 0
        local: dict = {}
        _settle(self._issue(params, local))
        return local

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` summed over the ranks that train the model (one all-reduce)."""
        if not _is_active(self.train_group):
            return values
        values = values.clone()
        dist.all_reduce(values, group=self.train_group)
        self.last_comm_bytes += values.numel() * values.element_size()
        return values


class FSDP2(DataParallel):
    """The communication of a step over FSDP2's ``Shard(0)`` DTensor parameters
    (``fully_shard`` after ``rgc.wrap``), and data parallel for the parameters left whole.

    The sketches are reduce-scattered, so each rank holds the sketch rows of the weight rows
    it owns, and the rule runs on those rows only (a :class:`RowShard` view of the weight, a
    :class:`LocalState` view of its state: RowAdam's moments are ``rows x r`` and ``rows``).
    The sums the rule's coefficients need (:class:`rgc.optim.rules.Partials`: ``||W||^2``,
    ``||H||^2 = sum((C P^T P) * C)``, non-finite counts) are summed over the ranks with one
    all-reduce for all sharded parameters, so every rank forms the same coefficients; the
    rows are written with rounding offset ``first_row * k``, the bits they get in the
    unsharded update. No rank forms more than ``chunk_rows x k`` of ``H`` (the kernel none),
    nor a d x k gradient. Other trainable DTensor parameters take FSDP's averaged ``.grad``
    through the same rule on their local rows; parameters left whole (``ignored_params``) are
    averaged over ``group`` as in :class:`DataParallel`.

    A step controller (:class:`rgc.PredictedKL`) sees whole updates: the d x r factors of the
    row shards are all-gathered for it (never a d x k tensor), and it sums its probe
    statistics over the ranks. Each rank probes its own batch (set with ``set_probe`` on every
    rank): the KL is the mean over all ranks' probe tokens. It needs every trainable sharded
    parameter to be sketched (checked when attached). ``export_update(model)`` is collective
    (every rank calls it): the factors of the row shards are all-gathered (d x r), and the
    fingerprints of the whole weights summed from each rank's share.

    A stack of experts (``[E, d, k]``, sketch ``E x d x r``) sharded by FSDP2's default
    ``Shard(0)`` gives each rank whole experts: its sketches are reduce-scattered over experts
    (each rank receives the ``n x d x r`` of its own), and the rule runs on those experts
    (an :class:`ExpertShard` view), whose partial sums are complete on the rank; the sums of
    all E matrices that ``expert_norm='stack'`` and clipping read are exchanged in the same
    one all-reduce (:attr:`rgc.optim.rules.Partials.whole`). Nothing ``E x d x k`` is
    gathered: an expert's update is written where its rows live, with the rounding offset
    ``first_expert * d * k``.

    Not supported (raise when attached): 2-D meshes (HSDP, tensor parallel) and placements
    other than ``Shard(0)``.
    """

    def __init__(self, group=None, bucket_mb: float = DEFAULT_BUCKET_MB):
        super().__init__(group, bucket_mb)
        self.mesh_group = None
        self._shards: dict[int, ShardEntry] = {}

    @property
    def train_group(self):
        """The group the model trains over: the mesh's, else ``group``."""
        return self.mesh_group if self.mesh_group is not None else self.group

    def attach(self, optimizer) -> None:
        sharded = [p for p in _params_of(optimizer) if isinstance(p, DTensor)]
        for p in sharded:
            _check_sharded(p)
            owner = sketched_owner_of(p)
            if optimizer.step_control is not None and owner is None and p.requires_grad:
                raise NotImplementedError(
                    f"step_control under FSDP2 needs every trainable sharded parameter to be "
                    f"sketched; {tuple(p.shape)} is not: the controller's forward-mode probe "
                    "cannot put a tangent on a parameter FSDP2 gathers itself. Freeze it "
                    "(rgc.wrap(..., freeze_others=True), the default) or keep it whole with "
                    "fully_shard(..., ignored_params=...)")
        if any(p.device_mesh != sharded[0].device_mesh for p in sharded):
            raise NotImplementedError("all sharded parameters must share one device mesh")
        self.mesh_group = sharded[0].device_mesh.get_group() if sharded else None
        check_seeds(optimizer, group=self.train_group)

    # -- before the rule -------------------------------------------------------------------
    def _issue(self, params: list[torch.Tensor], local: dict) -> list[_Pending]:
        """Also reduce-scatter the sharded sketches into ``local`` (one rank: its own)."""
        pending = super()._issue(params, local)
        sharded = [(p, sketched_owner_of(p)) for p in params if isinstance(p, DTensor)]
        sharded = [(p, owner) for p, owner in sharded if owner is not None]
        if sharded and _is_active(self.mesh_group):
            more, sent = _reduce_scatter_rows(sharded, self.mesh_group, self.bucket_bytes, local)
            pending += more
            self.last_comm_bytes += sent
        else:  # one rank holds every row
            local.update({id(p): owner.sketch for p, owner in sharded
                          if owner.sketch is not None})
        return pending

    def view(self, entry: Entry, exchanged: dict) -> Entry:
        """A ``Shard(0)`` parameter's entry as this rank's rows (:class:`ShardEntry`)."""
        p, owner = entry.param, entry.owner
        if not isinstance(p, DTensor):
            return entry
        first_row, _ = _row_range(p)
        local = p.to_local()  # a view of this rank's rows (whole experts of a stack)
        view = None
        if owner is not None and owner.num_matrices > 1:
            matrices = local.transpose(1, 2) if getattr(owner, "transposed", False) else local
            view = ExpertShard(owner, matrices, exchanged.pop(id(p)), first_row)
        elif owner is not None:
            view = RowShard(owner, local, exchanged.pop(id(p)), first_row)
        else:
            local.grad = p.grad.to_local()
        shard = ShardEntry(local, view, entry.group, LocalState(entry.state, p), entry.seed,
                           first_row * math.prod(p.shape[1:]), entry.index, whole=p)
        self._shards[id(local)] = shard
        return shard

    def reduce(self, measured) -> None:
        """Complete this rank's partial sums over the mesh: one all-reduce, in parameter order
        (the same on every rank, whatever the grouping by local shape).

        A row shard's sums are summed over the ranks. An expert shard's are complete (its
        experts are whole here); each rank puts them at its experts' positions in zeros for
        all E, so that the sum holds every expert's, bit for bit (adding zeros is exact): they
        become ``partials.whole`` of the stack group."""
        rows = sorted(((e.index, partials, m, e) for entries, partials in measured
                       for m, e in enumerate(entries) if isinstance(e, ShardEntry)),
                      key=lambda row: row[0])
        if not rows or not _is_active(self.mesh_group):
            return
        names = [sorted(partials.sums) for _, partials, _, _ in rows]
        segments = []
        for (_, partials, m, e), row_names in zip(rows, names, strict=True):
            values = [(~partials.finite[m]).to(torch.float32),
                      *(partials[name][m] for name in row_names)]
            if isinstance(e.owner, ExpertShard):
                first, total = e.owner.first_row, e.owner.total_matrices
                values = [F.pad(v, (first, total - first - v.shape[0])) for v in values]
            segments += values
        flat = torch.cat(segments)
        dist.all_reduce(flat, group=self.mesh_group)
        self.last_comm_bytes += flat.numel() * flat.element_size()
        wholes: dict[int, tuple[Partials, dict[int, list]]] = {}
        offset = 0
        for (_, partials, m, e), row_names in zip(rows, names, strict=True):
            experts = isinstance(e.owner, ExpertShard)
            width = e.owner.total_matrices if experts else partials.finite.shape[1]
            values = [flat[offset + j * width:offset + (j + 1) * width]
                      for j in range(1 + len(row_names))]
            offset += width * (1 + len(row_names))
            if experts:
                wholes.setdefault(id(partials), (partials, {}))[1][m] = values
                continue
            partials.finite[m] = values[0] == 0  # no rank saw a non-finite value
            for name, value in zip(row_names, values[1:], strict=True):
                partials[name][m] = value
        for partials, by_member in wholes.values():
            stacked = [torch.stack(column) for column in
                       zip(*(by_member[m] for m in range(len(by_member))), strict=True)]
            partials.whole = Partials(stacked[0] == 0,
                                      dict(zip(sorted(partials.sums), stacked[1:], strict=True)))

    def keeps_weight_norm(self, entry) -> bool:
        # a row shard's ||W||^2 is this rank's partial sum: recomputed from the rows each step
        return not isinstance(entry, ShardEntry)

    def finish(self) -> None:
        self._shards = {}

    # -- step control ----------------------------------------------------------------------
    def whole_updates(self, updates: list) -> list:
        """The controller's updates with each row shard's factor all-gathered (d x r)."""
        shards = sorted(((self._shards[id(u.param)], i) for i, u in enumerate(updates)
                         if id(u.param) in self._shards), key=lambda s: s[0].index)
        if not shards:
            return updates
        whole = self._of_whole([(updates[i], e) for e, i in shards])
        out = list(updates)
        for (_, i), update in zip(shards, whole, strict=True):
            out[i] = update
        return out

    def _of_whole(self, shares: list[tuple], *, export: bool = False) -> list:
        """The updates of whole parameters from this rank's ``(update, ShardEntry)`` shares,
        in the same order on every rank: the row shards' factors (d x r) or dense directions,
        and the expert shards' factors (E x d x r) with their per-expert coefficients,
        all-gathered (one bucketed gather)."""
        values = [(u.factor if isinstance(u, LowRankUpdate) else u.direction, e)
                  for u, e in shares]
        experts = [(u, e) for u, e in shares if isinstance(e.owner, ExpertShard)]
        values += [(torch.stack([torch.as_tensor(x, dtype=torch.float32, device=u.factor.device)
                                 .expand(u.factor.shape[0]) for x in (u.coef, u.decay, u.active)],
                                dim=1), e) for u, e in experts]
        whole = self._gathered(values, export=export)
        scalars = iter(whole[len(shares):])
        out = []
        for (u, e), value in zip(shares, whole[:len(shares)], strict=True):
            if isinstance(u, DenseUpdate):
                out.append(dataclasses.replace(u, param=e.whole, direction=value, offset=0))
                continue
            update = dataclasses.replace(u, param=e.whole, layer=e.owner.owner, factor=value)
            if isinstance(e.owner, ExpertShard):
                coef, decay, active = next(scalars).unbind(1)
                update.coef, update.active = coef, active != 0
                if torch.is_tensor(u.decay) or u.decay != 0:
                    update.decay = decay
            out.append(update)
        return out

    def _gathered(self, items: list[tuple[torch.Tensor, ShardEntry]], *,
                  export: bool = False) -> list[torch.Tensor]:
        """The whole FP32 tensors of row shards' local values (``rows x ...`` each)."""
        local = [(t.detach().reshape(t.shape[0], math.prod(t.shape[1:])).to(torch.float32),
                  e.whole.shape[0]) for t, e in items]
        if not _is_active(self.mesh_group):
            whole = [t for t, _ in local]
        else:
            whole, sent = _all_gather_rows(local, self.mesh_group, self.bucket_bytes)
            if export:
                self.last_export_bytes += sent
            else:
                self.last_comm_bytes += sent
        return [w.reshape(e.whole.shape[0], *t.shape[1:]) for w, (t, e) in
                zip(whole, items, strict=True)]

    # -- sketch-sized sync -----------------------------------------------------------------
    def keep(self, update) -> list[KeptUpdate | _ShardRecord]:
        members = update.members() if isinstance(update, StackUpdate) else [update]
        kept = []
        for m in members:
            shard = self._shards.get(id(m.param))
            if shard is None:
                kept += super().keep(m)
                continue
            if isinstance(m, LowRankUpdate):
                m.factor = m.factor.clone()
                seed = shard.owner.projection_seed
            else:
                m.direction = m.direction.detach().to(torch.float32, copy=True)
                seed = None
            kept.append(_ShardRecord(m, shard, fingerprint_tensor(shard.param, shard.offset),
                                     seed))
        return kept

    def payload_records(self, records: list) -> list[KeptUpdate]:
        """Records of whole parameters: the row shards' factors (or dense directions)
        all-gathered, and their fingerprints before and after summed from each rank's share."""
        self.last_export_bytes = 0
        out = [r for r in records if not isinstance(r, _ShardRecord)]
        shards = sorted((r for r in records if isinstance(r, _ShardRecord)),
                        key=lambda r: r.entry.index)
        if not shards:
            return out
        whole = self._of_whole([(r.update, r.entry) for r in shards], export=True)
        shares = torch.stack([torch.stack([r.base_share for r in shards]), torch.stack(
            [fingerprint_tensor(r.entry.param, r.entry.offset) for r in shards])])
        if _is_active(self.mesh_group):
            dist.all_reduce(shares, group=self.mesh_group)
            self.last_export_bytes += shares.numel() * shares.element_size()
        shares = shares % FINGERPRINT_MODULUS
        for r, update, base, result in zip(shards, whole, shares[0], shares[1], strict=True):
            out.append(KeptUpdate(update, base, r.projection_seed, result))
        return out


def communication(params, group=None, bucket_mb: float = DEFAULT_BUCKET_MB) -> DataParallel:
    """The strategy for ``params`` (tensors or param groups): :class:`FSDP2` when any is a
    DTensor, else :class:`DataParallel`."""
    tensors = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
    kind = FSDP2 if any(isinstance(p, DTensor) for p in tensors) else DataParallel
    return kind(group, bucket_mb)


class _Distributed:
    """What the two distributed optimizers add: the strategy chosen from the parameters, and
    its byte counters."""

    def __init__(self, params, *args, group=None, bucket_mb: float = DEFAULT_BUCKET_MB,
                 **kwargs):
        params = list(params)
        super().__init__(params, *args, comm=communication(params, group, bucket_mb), **kwargs)

    @property
    def last_comm_bytes(self) -> int:
        """Bytes this rank passed to collectives in the last ``step()``."""
        return self.comm.last_comm_bytes

    @property
    def last_export_bytes(self) -> int:
        """Bytes this rank passed to collectives in the last ``export_update()``."""
        return self.comm.last_export_bytes


class DistributedRGCOptimizer(_Distributed, RGCOptimizer):
    """:class:`rgc.RGCOptimizer` for data parallel and FSDP2 training on ``torch.distributed``.

    Same update, arguments and state as ``RGCOptimizer`` (``step_control`` and
    ``keep_updates`` included), plus ``group`` (process group of the plain-tensor parameters,
    default the whole world; sharded ones use their device mesh's) and ``bucket_mb`` (largest
    bucket of one collective, in MiB): ``RGCOptimizer(..., comm=...)`` with the strategy the
    parameters need, :class:`FSDP2` if any is a ``Shard(0)`` DTensor, else
    :class:`DataParallel` (see them for what crosses the network). On one process (no process
    group) it is ``RGCOptimizer``.
    """


class DistributedRowAdam(_Distributed, RowAdam):
    """:class:`rgc.RowAdam` for data parallel and FSDP2 training on ``torch.distributed``.

    Same update, arguments and state as ``RowAdam``, plus ``group`` and ``bucket_mb`` (see
    :class:`DistributedRGCOptimizer`). Under FSDP2 the moments live with the rows each rank
    owns (``exp_avg``: rows x r, ``exp_avg_sq``: rows, stored as ``Shard(0)`` DTensors), and
    a rank's rows are updated with the bits of the unsharded update of those rows.
    """
