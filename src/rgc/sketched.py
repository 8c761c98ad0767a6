"""What every owner of a sketched weight provides: the projection, its version and the sketch.

A sketched weight is a stack of ``E`` matrices of size d x k (``E = 1`` for the 2-D weight of
a :class:`rgc.CompressedLinear`; ``E`` experts for a 3-D expert weight), with one projection
``P`` (k x r, in the weight's dtype) shared by the stack and one FP32 sketch per matrix. The
optimizers, step control, sync and distributed code see every owner through this interface
only, so a stack of experts and a single linear layer take the same path.

The sketch arrives through a *sketch slot*: a zero-stride FP32 leaf of the sketch's shape that
holds no memory. The autograd Function of the owner returns ``D^T (X P)`` as the slot's
gradient; autograd's accumulation hands it to :func:`_take_sketch`, which adds it to
``owner.sketch``. A slot belongs to one projection: it is replaced when ``P`` changes, so the
backward of a forward run with an old ``P`` fails instead of adding to the wrong basis.
"""

from __future__ import annotations

import weakref

import torch

from rgc.projection import make_projection
from rgc.registry import register_owner
from rgc.seeding import derive_seed

REFRESH_HELP = "refresh must be 'every_step', 'never' or a positive int N (every N updates)"


def check_refresh(refresh) -> None:
    """ValueError unless ``refresh`` is 'every_step', 'never' or an int >= 1."""
    ok = refresh in ("every_step", "never") or (
        isinstance(refresh, int) and not isinstance(refresh, bool) and refresh >= 1)
    if not ok:
        raise ValueError(f"{REFRESH_HELP}, got {refresh!r}")


_ZEROS: dict[torch.device, torch.Tensor] = {}


def _zero_scalar(device: torch.device) -> torch.Tensor:
    """One FP32 zero per device, the storage behind every sketch slot (never written)."""
    device = torch.device(device)
    if device not in _ZEROS:
        _ZEROS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return _ZEROS[device]


def _take_sketch(owner_ref: weakref.ref, slot: torch.Tensor) -> None:
    """Move the gradient autograd accumulated on a sketch slot into ``owner.sketch``."""
    grad, slot.grad = slot.grad, None
    owner = owner_ref()
    if owner is None:
        return
    if slot is not owner._sketch_slot:
        raise RuntimeError(
            "the projection of this sketched weight changed between forward and backward "
            "(optimizer.step() ran in between); call backward before step()")
    if owner.sketch is None:
        owner.sketch = grad
    else:
        owner.sketch.add_(grad)


class SketchedWeight:
    """Mixin of the owners of sketched weights (:class:`rgc.CompressedLinear`, expert weights).

    Subclasses provide ``weight`` (the Parameter), ``projection`` (P, k x r, the weight's dtype),
    ``in_features`` (k), ``out_features`` (d), ``num_matrices`` (E) and
    :meth:`weight_matrices`, and call :meth:`_setup_sketching` once the weight exists.

    State: ``rank``, ``projection_kind``, ``refresh`` ('every_step', 'never' or N),
    ``seed`` (int), ``projection_version`` (int), ``sketch`` (FP32, :attr:`sketch_shape`, or
    ``None`` when nothing was back-propagated since the last step).
    """

    num_matrices: int = 1

    def _setup_sketching(self, rank: int, projection: str, refresh, seed: int) -> None:
        check_refresh(refresh)
        self.rank = rank
        self.projection_kind = projection
        self.refresh = refresh
        self.seed = int(seed)
        self.projection_version = 0
        self.sketch: torch.Tensor | None = None

    @property
    def sketch_shape(self) -> tuple[int, ...]:
        """``(d, r)`` for a 2-D weight, ``(E, d, r)`` for a stack."""
        return (self.out_features, self.rank)

    def weight_matrices(self) -> torch.Tensor:
        """The weight as ``[E, d, k]`` (a view; strided for weights stored transposed)."""
        raise NotImplementedError

    def sketch_matrices(self) -> torch.Tensor | None:
        """The sketch as ``[E, d, r]`` FP32 (a view), or ``None``."""
        if self.sketch is None:
            return None
        return self.sketch.reshape(self.num_matrices, self.out_features, self.rank)

    @property
    def projection_seed(self) -> int:
        """Seed of the current ``P``: a function of the owner's seed and the version."""
        return derive_seed(self.seed, self.projection_version)

    def _make_projection(self) -> torch.Tensor:
        return make_projection(self.projection_kind, self.in_features, self.rank,
                               seed=self.projection_seed, device=self.weight.device,
                               dtype=self.weight.dtype)

    def set_projection_version(self, version: int, *, renew_sketch_slot: bool = True) -> None:
        """Regenerate ``P`` for ``version`` (in place, keeping the buffer).

        ``renew_sketch_slot=False`` leaves the new slot to the caller (``_new_sketch_slot()``):
        an optimizer renews every slot after all the projections of a step.
        """
        self.projection_version = int(version)
        make_projection(self.projection_kind, self.in_features, self.rank,
                        seed=self.projection_seed, out=self.projection)
        if renew_sketch_slot:
            self._new_sketch_slot()

    def materialise_projection(self) -> None:
        """Make ``P`` from its seed and version on the weight's device (in place when the
        buffer is already there, as after ``to_empty``; a new buffer when it is still a meta
        tensor) and a new sketch slot. RuntimeError if the result is not finite."""
        if self.projection.is_meta:
            self._set_projection_buffer(self._make_projection())
        else:
            make_projection(self.projection_kind, self.in_features, self.rank,
                            seed=self.projection_seed, out=self.projection)
        if not bool(torch.isfinite(self.projection).all()):  # once, at materialisation
            raise RuntimeError(
                f"the projection made for a sketched weight {tuple(self.weight.shape)} is not "
                f"finite (seed {self.seed}, version {self.projection_version}, "
                f"{self.projection.dtype}): report it, with these numbers")
        self._new_sketch_slot()

    def ensure_materialised(self) -> None:
        """Before a forward: make ``P`` if it is still a meta tensor while the weight is not
        (a model wrapped on the meta device whose weights were assigned, not materialised)."""
        if self.projection.is_meta and not self.weight.is_meta:
            self.materialise_projection()

    def _set_projection_buffer(self, projection: torch.Tensor) -> None:
        raise NotImplementedError

    def _new_sketch_slot(self) -> None:
        """A fresh sketch slot: an FP32 leaf of :attr:`sketch_shape` with zero strides."""
        shape = self.sketch_shape
        slot = _zero_scalar(self.weight.device).as_strided(shape, (0,) * len(shape))
        slot.requires_grad_(True)
        owner_ref = weakref.ref(self)
        slot.register_post_accumulate_grad_hook(lambda t: _take_sketch(owner_ref, t))
        self._sketch_slot = slot

    def zero_sketch(self, set_to_none: bool = True) -> None:
        """Drop the sketch (``set_to_none``) or zero it in place."""
        if set_to_none:
            self.sketch = None
        elif self.sketch is not None:
            self.sketch.zero_()

    def _register(self) -> None:
        register_owner(self.weight, self)
