"""rgc's primitives: each one PyTorch custom operator with two kernels behind it.

Every primitive is ``torch.ops.rgc.<name>`` (also importable from here), defined with
``torch.library.custom_op`` and carrying exactly two kernels: the PyTorch reference
(:mod:`rgc.ops.reference`; registered for every device, the CPU path and the oracle of the
tests) and a Triton kernel (:mod:`rgc.ops.triton`; registered for CUDA). The choice between
them is made here and nowhere else (:func:`implementation_for_device`): CUDA tensors run the
Triton kernel when Triton imports, everything else the reference; ``RGC_IMPL=torch`` or
``RGC_IMPL=triton`` forces one (Triton on the CPU only under ``TRITON_INTERPRET=1``, for
tests). Each op has a fake implementation, so it traces under ``torch.compile``.

The batched primitives take lists: one entry per *stack* ``[E, d, k]`` (a 2-D weight is a
stack of one), all of one shape in a Triton launch; coefficients are ``[M, E]`` device
tensors, seeds and offsets host ints. A list is one launch on the Triton path, whatever its
length: this is how an optimizer step's launches stay independent of the number of layers.

=======================  ==============================================================
``stochastic_round_``    FP32 -> BF16 with counter-based bits (:mod:`rgc.rounding`)
``random_words``         the hash words of those bits, int32
``lowrank_update_``      ``W <- W (1 - decay) - coef U P^T`` per matrix, one rounded
                         write, ``||W_new||^2`` out
``sum_squares``          ``||W||^2`` per matrix, the value the update writes
``sketch_stats``         ``||C P^T||^2`` from the r x r Gram, and finiteness, per matrix
``gaussian_matrices``    the Box-Muller ``G`` of a projection, per seed
``orthonormalize``       CholeskyQR of ``G`` (the orthonormal projection)
``make_projections_``    a projection per seed written into its buffer (the P refresh)
``row_adam_``            RowAdam's moments per matrix, the direction U written into S
=======================  ==============================================================

``pairwise_sums`` (a plain function, every device) is the fixed-order sum over the last
dimension that every reduction feeding a coefficient uses, but the weight norm, whose squares
and sums are float64 (docs/design.md, "One bit contract"); ``one_pass(k, r)`` says which
CholeskyQR variant ``orthonormalize`` runs (one pass for ``k >= 4 r``, shifted CholeskyQR3 in
float64 below).
"""

import functools
import inspect
import os

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from rgc.ops import reference
from rgc.ops.reference import one_pass, pairwise_sums

IMPLEMENTATIONS = ("torch", "triton")

__all__ = ["IMPLEMENTATIONS", "gaussian_matrices", "implementation", "implementation_for_device",
           "integer_loop", "lowrank_update_", "make_projections_", "one_pass", "orthonormalize",
           "pairwise_sums", "random_words", "row_adam_", "run_under_mode", "sketch_stats",
           "stochastic_round_", "sum_squares", "triton_available"]


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def implementation_for_device(device: torch.device) -> str:
    """'triton' or 'torch' for work on ``device``, honouring ``RGC_IMPL``."""
    device = torch.device(device)
    forced = os.environ.get("RGC_IMPL", "").strip().lower()
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"RGC_IMPL must be one of {IMPLEMENTATIONS}, got {forced!r}")
        if forced == "triton":
            if not triton_available():
                raise RuntimeError("RGC_IMPL=triton but Triton is not installed; "
                                   "pip install 'rgc-torch[triton]' or unset RGC_IMPL")
            if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
                raise RuntimeError(
                    f"RGC_IMPL=triton but the tensor is on {device}; Triton runs on CUDA "
                    "devices, or on the CPU only under TRITON_INTERPRET=1")
        return forced
    if device.type == "cuda" and triton_available():
        return "triton"
    return "torch"


def integer_loop(fn, device: torch.device):
    """``fn`` as the reference runs its integer hash loops on ``device``: on a CPU compiled
    into one loop (eager where torch.compile cannot run), elsewhere ``fn`` itself. ``fn`` must
    be elementwise torch code on integer tensors, whose result is the same either way (e.g. the
    fingerprint of :mod:`rgc.payload`)."""
    return reference._int32_loop(fn, device)


def _kernel(name: str, device: torch.device):
    """The implementation of op ``name`` for ``device``: the Triton launcher or the reference."""
    if implementation_for_device(device) == "triton":
        from rgc.ops import triton as triton_kernels

        return getattr(triton_kernels, name)
    return getattr(reference, name)


_RUNNERS: dict[str, object] = {}


def implementation(op) -> object:
    """The Python function behind ``torch.ops.rgc.<name>`` (an OpOverload or packet): the
    kernel choice and the kernel, run as plain torch code."""
    return _RUNNERS[op.name().split("::")[-1].split(".")[0]]


def run_under_mode(mode: TorchDispatchMode, op, args, kwargs):
    """Run rgc operator ``op`` from ``mode.__torch_dispatch__`` with ``mode`` active inside it.

    For dispatch modes that must see inside rgc's operators (the memory tracker, counters of
    host reads or launches), which they would otherwise see as one opaque call. The mode is
    pushed with the base class's ``__enter__``, so a subclass's own enter/exit logic does not
    run again.
    """
    TorchDispatchMode.__enter__(mode)
    try:
        return implementation(op)(*args, **(kwargs or {}))
    finally:
        TorchDispatchMode.__exit__(mode, None, None, None)


def _define(name: str, mutates_args, device_of):
    """Define ``rgc::name`` from its signature function (whose body is the fake
    implementation's) and register both kernels; ``device_of(*args)`` picks the device."""
    def decorate(signature):
        def run(*args):
            return _kernel(name, device_of(*args))(*args)
        _RUNNERS[name] = run
        run.__signature__ = inspect.signature(signature)
        run.__annotations__ = signature.__annotations__
        run.__name__, run.__doc__ = name, signature.__doc__
        op = torch.library.custom_op(f"rgc::{name}", run, mutates_args=mutates_args)
        for device_type in ("cpu", "cuda"):  # ops without tensor inputs need them by name
            op.register_kernel(device_type)(run)
        op.register_fake(signature)
        return op
    return decorate


def _first(tensors: list[Tensor], fallback=None) -> torch.device:
    return tensors[0].device if tensors else torch.device(fallback or "cpu")


# ------------------------------------------------------------------------------ operators

@_define("stochastic_round_", ("out",), lambda out, *_: out.device)
def stochastic_round_(out: Tensor, x: Tensor, seed: int, offset: int) -> None:
    """``out <- BF16(x)`` stochastically, element ``i`` of ``x.flatten()`` with the bits of
    flat index ``offset + i``; out: BF16 of x's shape (any strides), x: floating point."""
    return None


@_define("random_words", (), lambda numel, seed, label, offset, device: device)
def random_words(numel: int, seed: int, label: str, offset: int,
                 device: torch.device) -> Tensor:
    """The hash words of flat indices ``offset .. offset + numel - 1`` (int32 patterns) for
    ``(seed, label)``: :func:`rgc.bits.random_bits` reinterpreted as int32."""
    return torch.empty(numel, dtype=torch.int32, device=device)


@_define("lowrank_update_", ("weights", "sq_norms"), lambda weights, *_: _first(weights))
def lowrank_update_(weights: list[Tensor], factors: list[Tensor], projections: list[Tensor],
                    coefs: Tensor, decays: Tensor | None, seeds: list[int], offsets: list[int],
                    row_lengths: list[int], stochastic_rounding: bool, chunk_rows: int,
                    sq_norms: Tensor | None) -> None:
    """Per matrix ``(m, e)``: ``W <- W (1 - decay) - coef U P^T``, FP32 arithmetic and one
    write; see :func:`rgc.ops.reference.lowrank_update_` for shapes and the bit contract."""
    return None


@_define("sum_squares", (), lambda weights, chunk_rows: _first(weights))
def sum_squares(weights: list[Tensor], chunk_rows: int) -> Tensor:
    """``||W_e||^2`` per matrix of each ``[E, d, k]`` stack: ``[M, E]`` FP32."""
    e = weights[0].shape[0] if weights else 0
    return torch.empty(len(weights), e, dtype=torch.float32, device=_first(weights))


@_define("sketch_stats", (), lambda sketches, projections: _first(sketches))
def sketch_stats(sketches: list[Tensor], projections: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(||C_e P^T||^2 [M, E] FP32, all(isfinite(C_e)) [M, E] bool)`` per matrix."""
    e = sketches[0].shape[0] if sketches else 0
    device = _first(sketches)
    return (torch.empty(len(sketches), e, dtype=torch.float32, device=device),
            torch.empty(len(sketches), e, dtype=torch.bool, device=device))


@_define("gaussian_matrices", (), lambda k, r, seeds, device: device)
def gaussian_matrices(k: int, r: int, seeds: list[int], device: torch.device) -> Tensor:
    """Box-Muller ``G`` per seed, ``[M, k, r]`` FP32, a view of ``[M, k, 2 ceil(r/2)]`` (see
    :func:`rgc.ops.reference.gaussian_matrices`)."""
    return torch.empty(len(seeds), k, 2 * ((r + 1) // 2), dtype=torch.float32,
                       device=device)[:, :, :r]


@_define("make_projections_", ("outs",), lambda outs, kind, seeds: _first(outs))
def make_projections_(outs: list[Tensor], kind: str, seeds: list[int]) -> None:
    """The projection of ``kind`` for ``seeds[m]`` written into ``outs[m]`` (k x r, any
    float dtype); see :func:`rgc.ops.reference.make_projections_` and :mod:`rgc.projection`."""
    return None


@_define("orthonormalize", (), lambda g, scale, gram_fp64: g.device)
def orthonormalize(g: Tensor, scale: float, gram_fp64: bool) -> Tensor:
    """``scale Q`` of the thin QR of each ``g[m]`` (CholeskyQR); FP32, or float64 for k < 4 r."""
    k, r = g.shape[1:]
    return torch.empty_like(g, dtype=torch.float32 if one_pass(k, r) else torch.float64)


@_define("row_adam_", ("sketches", "exp_avgs", "exp_avg_sqs"),
         lambda sketches, *_: _first(sketches))
def row_adam_(sketches: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
              active: Tensor, steps: Tensor, beta1: float, beta2: float, eps: float,
              maximize: bool) -> None:
    """RowAdam per matrix ``(m, e)``: the moments ``m`` (``[E, d, r]``) and ``v`` (``[E, d]``)
    updated from the sketch where ``active``, then ``U`` written into the sketch; see
    :func:`rgc.ops.reference.row_adam_` for the formula and the bit contract."""
    return None
