"""Policy sync, the receiving side: replay a step's payload bit-exactly on a copy of the model.

The payload (``optimizer.export_update(model)``; format, fingerprints and checksum in
:mod:`rgc.payload`) carries each updated parameter's factor or direction, coefficients and
seeds. :func:`apply_update` decodes it, checks every entry against the receiver's tensors, then
applies each update with the functions the optimizer uses (:mod:`rgc.updates`), so a receiver
that started from the trainer's weights holds bit-identical weights after every step (on the
same device type).

The payload's checksum is checked before anything else, so a payload altered or corrupted after
export is refused with the receiver untouched; after applying, each tensor is compared with its
``N/result`` fingerprint, so a receiver whose arithmetic diverges (another device type, another
rgc or torch build) raises at that step rather than one step later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from rgc.payload import PayloadEntry, PayloadError, decode, fingerprint
from rgc.projection import make_projection
from rgc.updates import apply_dense_update_, apply_lowrank_update_


@dataclass
class _Write:
    """One entry matched to the receiver: its tensor, and the d x k matrices the update
    writes (the tensor itself, or a stack's ``[E, d, k]`` view of it)."""

    entry: PayloadEntry
    tensor: torch.Tensor
    matrices: torch.Tensor


def _matched(entry: PayloadEntry, tensor: torch.Tensor) -> _Write:
    """Check ``entry`` against the receiver's ``tensor`` (shapes, dtype, base fingerprint)."""
    name, matrices = entry.name, tensor
    if entry.stack is not None:
        if tensor.dim() != 3 or tensor.shape[0] != entry.stack.count:
            raise PayloadError(f"{name!r} carries the update of a stack of {entry.stack.count} "
                               f"experts but the receiver's tensor has shape "
                               f"{tuple(tensor.shape)}")
        matrices = tensor.transpose(1, 2) if entry.stack.transposed else tensor
    if entry.dtype != tensor.dtype:
        raise PayloadError(f"{name!r}: the update was made for {entry.dtype} weights but the "
                           f"receiver's are {tensor.dtype}; convert the receiver to the "
                           "trainer's dtype")
    if entry.lowrank:
        if matrices.dim() != (3 if entry.stack else 2):
            raise PayloadError(f"{name!r} carries a low-rank update but the receiver's tensor "
                               f"has shape {tuple(tensor.shape)}, not d x k")
        want = (*matrices.shape[:-2], matrices.shape[-2], entry.projection.r)
        if tuple(entry.values.shape) != want or entry.projection.k != matrices.shape[-1]:
            raise PayloadError(
                f"{name!r}: payload factor {tuple(entry.values.shape)} with projection "
                f"(k={entry.projection.k}, r={entry.projection.r}) does not fit the receiver's "
                f"weight {tuple(tensor.shape)} (expected a factor of shape "
                f"{want[:-1] + ('r',)} and k={matrices.shape[-1]})")
    elif entry.values.shape != tensor.shape:
        raise PayloadError(f"{name!r}: payload direction {tuple(entry.values.shape)} does not "
                           f"fit the receiver's parameter {tuple(tensor.shape)}")
    if fingerprint(tensor) != entry.base:
        raise PayloadError(
            f"the receiver's {name!r} is not the tensor this update was computed from "
            "(fingerprint mismatch): an update was missed, repeated or reordered, or the "
            "receiver started from other weights. Resend a full copy of the weights.")
    return _Write(entry, tensor, matrices)


def _coefficient(value, device):
    """A coefficient for the apply functions: a float as it is, a stack's float64 ``[E]`` as
    FP32 on ``device`` (all zero: the float 0, which the apply functions read as "no
    decay")."""
    if not torch.is_tensor(value):
        return value
    return 0.0 if not value.any() else value.to(device=device, dtype=torch.float32)


def _apply(write: _Write) -> None:
    entry, device = write.entry, write.tensor.device
    if entry.lowrank:
        spec = entry.projection
        projection = make_projection(spec.kind, spec.k, spec.r, seed=spec.seed, device=device,
                                     dtype=write.tensor.dtype)
        apply_lowrank_update_(write.matrices, entry.values.to(device), projection,
                              _coefficient(entry.coef, device),
                              decay=_coefficient(entry.decay, device), seed=entry.seed,
                              chunk_rows=entry.chunk_rows,
                              stochastic_rounding=entry.stochastic_rounding)
    else:
        apply_dense_update_(write.tensor, entry.values.to(device), entry.coef,
                            decay=entry.decay, seed=entry.seed,
                            stochastic_rounding=entry.stochastic_rounding)


@torch.no_grad()
def apply_update(target: nn.Module | dict[str, torch.Tensor], payload: dict[str, torch.Tensor]
                 ) -> None:
    """Apply a payload from ``optimizer.export_update(model)`` to a receiver, in place.

    Args:
        target: a module with the trainer model's parameter names (wrapped or not), or a
            state dict of such tensors (e.g. ``model.state_dict()``, whose tensors share the
            module's storage).
        payload: the dict of tensors (e.g. loaded with ``safetensors.torch.load_file``).

    Every entry is checked first (format, the payload's checksum, known parameter names,
    shapes and dtypes, finite values, the fingerprint of each receiving tensor, and for a
    module the step order), and :class:`rgc.payload.PayloadError` (a ``ValueError``) is raised
    before any weight changes. A module remembers the last step it applied
    (``module.rgc_sync_step``); the next payload must carry the next step.

    After applying, each updated tensor's fingerprint must equal the trainer's (``N/result``);
    otherwise ``RuntimeError`` is raised: the receiver computed other bits than the trainer
    (e.g. another device type) and needs a full copy of the weights. ``rgc_sync_step`` is then
    not advanced.
    """
    decoded = decode(payload)
    step = decoded.step
    if isinstance(target, nn.Module):
        tensors = dict(target.named_parameters(remove_duplicate=False))
        last = getattr(target, "rgc_sync_step", None)
        if last is not None and step != last + 1:
            raise PayloadError(f"wrong step order: the receiver applied step {last} last, this "
                               f"payload is step {step} (expected {last + 1})")
    elif isinstance(target, dict):
        tensors = target
    else:
        raise TypeError(f"target must be an nn.Module or a state dict, got {type(target)}")
    unknown = sorted({e.name for e in decoded.entries} - set(tensors))
    if unknown:
        raise PayloadError(f"payload names parameters the receiver does not have: {unknown}; "
                           "the receiver must have the trainer model's parameter names")
    writes = [_matched(e, tensors[e.name]) for e in decoded.entries]
    for write in writes:
        _apply(write)
    diverged = [w.entry.name for w in writes if fingerprint(w.tensor) != w.entry.result]
    if diverged:
        raise RuntimeError(
            f"after applying step {step} the receiver's {diverged} differ from the trainer's "
            "(fingerprint of the expected result): the receiver computes other bits (another "
            "device type, or another rgc/torch build). Resend a full copy of the weights")
    if isinstance(target, nn.Module):
        target.rgc_sync_step = step
