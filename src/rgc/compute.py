"""Compute dtype: BF16-stored models trained with FP32 arithmetic where BF16 matmuls are slow.

On a CPU without native BF16 matrix instructions (AVX2-only x86, many servers and laptops)
PyTorch runs BF16 matmuls through a generic kernel, 10 to 25 times slower than FP32 ones. The
compute mode keeps every weight stored in its dtype (BF16) and runs each matmul in FP32 on
transient copies of its operands, returning the result in the stored dtype:

* :class:`rgc.CompressedLinear` layers get ``compute_dtype = torch.float32`` (forward, input
  gradient and ``X P``); the sketch ``C += D^T (X P)`` is FP32 as always, the weight is
  written only by the optimizer's stochastically rounded update, and no d x k weight gradient
  exists. Sketches equal those of the BF16 path up to FP32 rounding.
* every other matmul inside the model's forward (``F.linear`` of plain ``nn.Linear`` layers
  such as ``lm_head``, ``torch.matmul``/``bmm``/``mm`` of attention) whose operands are all
  BF16 (or FP16) CPU tensors runs the same way, through a ``TorchFunctionMode`` entered by
  forward hooks on the model. Their backward also runs in FP32 and saves the BF16 operands
  (not FP32 copies), so what autograd keeps is unchanged; gradients of trainable BF16 weights
  come back in BF16. Embedding lookups, norms (transformers' RMSNorm already computes in FP32)
  and elementwise ops are untouched: they are not slow in BF16.

**Memory.** Nothing persistent is added. Each matmul allocates, while it runs, FP32 copies of
its operands and an FP32 result before the cast back: for a linear layer of weight d x k on
n tokens, ``4 (d k + n k + n d)`` bytes (forward; the same bound in backward).
``rgc.estimate_memory(..., compute_dtype=torch.float32)`` adds the largest such transient.

**When.** :func:`choose_compute_mode` decides once per process and device: an explicit
``override`` argument, else the ``RGC_COMPUTE_DTYPE`` environment variable (``float32``,
``native`` or ``auto``), else, on a CPU with BF16/FP16 weights, a measurement (a few
milliseconds): FP32 when one BF16 ``F.linear`` takes more than :data:`SLOW_RATIO` times as long
as the same product upcast to FP32. CUDA and FP32 weights always compute natively.

    mode = rgc.compute.choose_compute_mode()          # cached; print(mode) says why
    handle = rgc.compute.use_compute_dtype(model, mode)   # after rgc.wrap(model, ...)
    ...                                                # train as usual
    handle.remove()                                    # back to native arithmetic

Limits: the mode covers the model's own ``forward`` in eager mode. Code run outside it
(a recomputation by activation checkpointing inside backward) computes natively, which is
correct but slow on such CPUs; under ``torch.autocast`` the autocast dtype wins.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from rgc.nn import compressed_layers

ENV_VAR = "RGC_COMPUTE_DTYPE"
#: FP32 compute is chosen when a BF16 matmul is more than this many times slower than FP32.
SLOW_RATIO = 2.0
LOW_PRECISION = (torch.bfloat16, torch.float16)

_OVERRIDES = {"float32": torch.float32, "fp32": torch.float32, "native": None, "auto": "auto"}


@dataclass(frozen=True)
class ComputeMode:
    """The arithmetic dtype chosen for low-precision weights, and why.

    ``dtype``: ``torch.float32``, or ``None`` to compute in the weights' own dtype.
    ``source``: 'override' (argument), 'environment' (``RGC_COMPUTE_DTYPE``), 'measured' or
    'device' (no choice to make: CUDA, or weights not in BF16/FP16). ``detail``: the figures.
    """

    dtype: torch.dtype | None
    source: str
    detail: str = ""

    @property
    def name(self) -> str:
        return "native" if self.dtype is None else str(self.dtype).removeprefix("torch.")

    def __str__(self) -> str:
        what = ("native (matmuls in the weights' dtype)" if self.dtype is None
                else f"{self.name} matmuls, weights stored as they are")
        return f"{what}; {self.source}" + (f": {self.detail}" if self.detail else "")


def _parse(value) -> torch.dtype | None | str:
    if value is None or isinstance(value, torch.dtype):
        if value not in (None, torch.float32):
            raise ValueError(f"compute dtype must be torch.float32 or None (native), got {value}")
        return value
    key = str(value).strip().lower()
    if key not in _OVERRIDES:
        raise ValueError(f"unknown compute mode {value!r}; use one of {sorted(_OVERRIDES)} "
                         f"(e.g. {ENV_VAR}=float32)")
    return _OVERRIDES[key]


@functools.cache
def measure_matmul_times(dtype: torch.dtype = torch.bfloat16, repeats: int = 5
                         ) -> tuple[float, float]:
    """Seconds of one CPU ``F.linear`` (64 x 256 by 256 x 256) in ``dtype``, and upcast to FP32.

    The fastest of ``repeats`` timings after a warm-up, on one thread (the ratio is a property
    of the kernels; with several threads on a loaded machine one descheduled thread stalls
    every call); cached per process (the first call costs a few milliseconds).
    """
    gen = torch.Generator().manual_seed(0)
    # Measured at several shapes on one Xeon: with native BF16 (AMX) the ratio is 0.4-0.5 at
    # this shape (1.6 at 32 x 128 x 128, where fixed costs dominate); limited to AVX2, 6-8.
    x = torch.randn(64, 256, generator=gen).to(dtype)
    w = torch.randn(256, 256, generator=gen).to(dtype)

    def best(fn):
        fn()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    with _one_thread():
        low = best(lambda: F.linear(x, w))
        upcast = best(lambda: F.linear(x.float(), w.float()).to(dtype))
    return low, upcast


@contextlib.contextmanager
def _one_thread():
    """Torch's intra-op threads set to one inside the block, restored after it."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@functools.cache
def bf16_matmul_scratch() -> bool:
    """Whether a BF16 matmul on this CPU holds an FP32 copy of its output while it runs.

    oneDNN does on x86 CPUs with AVX-512 but without BF16 instructions (AVX512_BF16, AMX):
    it accumulates into an FP32 buffer of the output's size, then rounds it into the BF16
    result. With BF16 instructions, or limited to AVX2 (``ONEDNN_MAX_CPU_ISA=AVX2``), it
    does not (with BF16 instructions its blocked kernels take a scratchpad of tens of KB per
    thread whatever the output's size, which the estimate leaves out).
    ``rgc.estimate_memory(..., bf16_matmul_scratch=True)`` models the FP32 copy (see
    docs/memory.md). Measured once per process: the allocator events of one 512 x 32 by
    32 x 512 product on one thread under torch's profiler, which must not be running already
    (the first call raises then); an FP32 copy is an allocation of at least 1 MiB, the
    scratchpad about 70 KB.
    """
    from torch.autograd.profiler import _is_profiler_enabled
    from torch.profiler import ProfilerActivity, profile

    if _is_profiler_enabled:
        raise RuntimeError("rgc.compute.bf16_matmul_scratch() measures under torch's profiler: "
                           "call it once before starting one (the answer is cached)")
    a = torch.ones(512, 32, dtype=torch.bfloat16)
    with _one_thread():  # a scratchpad per thread: on many threads as large as the copy
        torch.mm(a, a.T)  # oneDNN's first call sets up its kernel outside the measurement
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            torch.mm(a, a.T)
    fp32_copy = len(a) * len(a) * 4  # the 512 x 512 output in FP32
    return any(e.nbytes() >= fp32_copy for e in prof.profiler.kineto_results.events()
               if e.name() == "[memory]")


def choose_compute_mode(device="cpu", weight_dtype: torch.dtype = torch.bfloat16,
                        override=None) -> ComputeMode:
    """The compute mode for weights of ``weight_dtype`` on ``device`` (see the module doc).

    ``override``: ``torch.float32``/'float32', 'native' (or ``None`` to consult the
    environment and the measurement), 'auto'. The measurement is cached per process.
    """
    choice = _parse(override)
    source = "override"
    if override is None:
        env = os.environ.get(ENV_VAR)
        choice = _parse(env) if env else "auto"
        source = "environment" if env else "measured"
    if choice != "auto":
        return ComputeMode(choice, source, f"{ENV_VAR}={os.environ[ENV_VAR]}"
                           if source == "environment" else "")
    device = torch.device(device)
    if device.type != "cpu" or weight_dtype not in LOW_PRECISION:
        return ComputeMode(None, "device", f"{device.type}, {weight_dtype}")
    low, upcast = measure_matmul_times(weight_dtype)
    ratio = low / upcast
    name = str(weight_dtype).removeprefix("torch.")
    detail = (f"{name} matmul {1e6 * low:.0f} us vs {1e6 * upcast:.0f} us upcast to float32 "
              f"({ratio:.1f}x; CPU capability {torch.backends.cpu.get_cpu_capability()})")
    return ComputeMode(torch.float32 if ratio > SLOW_RATIO else None, "measured", detail)


def _compute_dtype(mode) -> torch.dtype | None:
    if isinstance(mode, ComputeMode):
        return mode.dtype
    choice = _parse(mode)
    if choice == "auto":
        raise ValueError("pass a ComputeMode (from choose_compute_mode), torch.float32 or "
                         "'native', not 'auto'")
    return choice


# -- FP32 arithmetic on low-precision operands, saving the operands as stored ---------------

class _UpcastLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, dtype):
        ctx.save_for_backward(x, weight)
        ctx.dtype, ctx.has_bias = dtype, bias is not None
        b = None if bias is None else bias.to(dtype)
        return F.linear(x.to(dtype), weight.to(dtype), b).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        dt = ctx.dtype
        g = grad_out.to(dt)
        gx = gw = gb = None
        if ctx.needs_input_grad[0]:
            gx = (g @ weight.to(dt)).to(x.dtype)
        g2 = g.reshape(-1, g.shape[-1])
        if ctx.needs_input_grad[1]:
            gw = (g2.t() @ x.reshape(-1, x.shape[-1]).to(dt)).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            gb = g2.sum(0).to(weight.dtype)
        return gx, gw, gb, None


class _UpcastMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b, dtype):
        ctx.save_for_backward(a, b)
        ctx.dtype = dtype
        return torch.matmul(a.to(dtype), b.to(dtype)).to(a.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        a, b = ctx.saved_tensors  # both at least 2-D, batch dimensions broadcast
        dt = ctx.dtype
        g = grad_out.to(dt)
        ga = gb = None
        if ctx.needs_input_grad[0]:
            ga = _sum_to(g @ b.to(dt).transpose(-1, -2), a.shape).to(a.dtype)
        if ctx.needs_input_grad[1]:
            gb = _sum_to(a.to(dt).transpose(-1, -2) @ g, b.shape).to(b.dtype)
        return ga, gb, None


def _sum_to(t: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """``t`` summed over the dimensions that broadcasting added to or expanded in ``shape``."""
    lead = t.dim() - len(shape)
    if lead:
        t = t.sum(tuple(range(lead)))
    dims = tuple(i for i, n in enumerate(shape) if n == 1 and t.shape[i] != 1)
    return t.sum(dims, keepdim=True) if dims else t


_MATMULS = frozenset({torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm,
                      torch.Tensor.bmm, torch.mm, torch.Tensor.mm})


class UpcastMatmuls(TorchFunctionMode):
    """Runs ``F.linear`` and ``matmul``/``bmm``/``mm`` of low-precision CPU tensors in ``dtype``.

    Only calls whose tensor operands all share one BF16/FP16 dtype on the CPU (and no ``out=``)
    are changed; the result comes back in that dtype. With autograd recording, a custom
    Function saves the operands as stored and runs the backward in ``dtype`` too.
    """

    def __init__(self, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (func is F.linear or func in _MATMULS) and "out" not in kwargs:
            tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
            low = tensors[0].dtype
            if (low in LOW_PRECISION and all(t.dtype == low and t.device.type == "cpu"
                                              for t in tensors)):
                grad = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
                if func is F.linear:
                    x, w, *rest = (*args, *kwargs.values())
                    bias = rest[0] if rest else None
                    if grad:
                        return _UpcastLinear.apply(x, w, bias, self.dtype)
                    return F.linear(x.to(self.dtype), w.to(self.dtype),
                                    None if bias is None else bias.to(self.dtype)).to(low)
                a, b = (*args, *kwargs.values())
                if grad and a.dim() >= 2 and b.dim() >= 2:
                    return _UpcastMatmul.apply(a, b, self.dtype)
                return torch.matmul(a.to(self.dtype), b.to(self.dtype)).to(low)
        return func(*args, **kwargs)


class ComputeHandle:
    """Returned by :func:`use_compute_dtype`; ``remove()`` restores native arithmetic."""

    def __init__(self, model: nn.Module, dtype: torch.dtype | None):
        self.model, self.dtype, self._hooks = model, dtype, []

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for _, layer in compressed_layers(self.model):
            layer.compute_dtype = None


def use_compute_dtype(model: nn.Module, mode) -> ComputeHandle:
    """Make ``model``'s matmuls run in the compute dtype of ``mode``; weights stay as stored.

    Args:
        model: any ``nn.Module``; call this after :func:`rgc.wrap` (it sets ``compute_dtype``
            on the CompressedLinear layers present now) and after adapters such as peft's
            are attached (the hooks go on ``model``, whose forward must be the one called).
        mode: a :class:`ComputeMode` (from :func:`choose_compute_mode`), ``torch.float32``,
            or 'native'/``None`` (nothing is changed).

    Returns a :class:`ComputeHandle`. See the module docstring for what runs in FP32 and the
    transient memory it costs.
    """
    dtype = _compute_dtype(mode)
    handle = ComputeHandle(model, dtype)
    if dtype is None:
        return handle
    for _, layer in compressed_layers(model):
        layer.compute_dtype = dtype
    upcast = UpcastMatmuls(dtype)
    depth = [0]  # a model calling itself (or the same hooks twice) enters the mode once

    def enter(module, args):
        if depth[0] == 0:
            upcast.__enter__()
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1
        if depth[0] == 0:
            upcast.__exit__(None, None, None)

    handle._hooks = [model.register_forward_pre_hook(enter),
                     model.register_forward_hook(leave, always_call=True)]
    return handle
