"""Ahead-of-time compilation of every kernel configuration, and the resources each one uses.

No GPU is needed: Triton's NVIDIA backend compiles for a named architecture with the
``ptxas`` that ships in the Triton wheel, and ``cuobjdump --dump-resource-usage`` (also in the
wheel) reads registers and stack bytes from the cubin. A configuration that spills registers
has a stack frame (spilled values live in local memory), so ``stack == 0`` means spill-free.

The launches compiled are the launchers' own (``*_launches`` in :mod:`rgc.ops.triton`) for
small CPU tensors, bound by Triton's own argument specialisation (as a launch on a GPU would
bind them), so what is checked is what runs; launches with equal specialisations are
compiled once. The layouts cover the specialisations a launch can meet: aligned (dimensions
and strides multiples of 16), misaligned (odd dimensions and strides, a column slice starting
at an odd column, a flat offset past 2**32), an odd rank with an aligned W, r = 1 (Triton
turns arguments equal to 1 into constants), and transposed expert storage (unit stride on d),
each with and without weight decay; and the norm-only pass of ``sum_squares``.

A developer tool, not part of the installed package (it reuses Triton's private argument
binding, ``JITFunction._pack_args``): imported from a checkout as ``tools.aot`` by
``tests/test_ops_aot.py`` and ``benchmarks/gpu_kernels.py --registers``. Requires the kernels
to be loaded compiled, not interpreted (``TRITON_INTERPRET`` unset when
:mod:`rgc.ops.triton` was imported).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import re
import subprocess
import tempfile

import torch
import triton

from rgc.ops import triton as K
from rgc.ops.reference import one_pass

ARCHS = (80, 90, 100)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)
PROJECTION_DTYPES = (torch.bfloat16, torch.float32)


@dataclasses.dataclass(frozen=True)
class Usage:
    """Resources of one compiled kernel, per thread (registers, stack bytes) or per block."""
    kernel: str
    arch: int
    case: str
    num_warps: int
    registers: int
    stack: int
    local: int
    shared: int


def _bin_dir() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def toolchain_missing() -> str | None:
    """Why AOT compilation cannot run here (a sentence), or None when it can."""
    if K.INTERPRETED:
        return "the kernels are loaded interpreted (TRITON_INTERPRET=1) in this process"
    try:
        from triton.backends.compiler import GPUTarget  # noqa: F401
        from triton.compiler import make_backend  # noqa: F401
        from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: F401
    except ImportError as exc:
        return f"this Triton has no ahead-of-time compiler API ({exc})"
    if not hasattr(JITFunction, "_pack_args"):
        return "this Triton's JIT has no _pack_args (the argument binding reused here)"
    for tool in ("ptxas", "cuobjdump"):
        if not os.access(os.path.join(_bin_dir(), tool), os.X_OK):
            return f"the Triton wheel ships no {tool} in {_bin_dir()}"
    return None


def _target(arch: int):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", arch, 32)


@functools.cache
def _binder(kernel, arch: int):
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target(arch))
    return backend, create_function_from_signature(kernel.signature, kernel.params, backend)


def _bind(kernel, args: tuple, kwargs: dict, arch: int):
    backend, binder = _binder(kernel, arch)
    kwargs = dict(kwargs, debug=False)
    return backend, kwargs, *binder(*args, **kwargs)


def specialization(kernel, args: tuple, kwargs: dict, arch: int = 90) -> str:
    """The JIT's key for a launch: launches with equal keys run the same compiled kernel."""
    _, _, _, spec, options = _bind(kernel, args, kwargs, arch)
    return repr((kernel.__name__, spec, sorted(options.items())))


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int):
    """Compile one launch ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>``, as the JIT would."""
    from triton.compiler import ASTSource

    backend, kwargs, bound_args, spec, options = _bind(kernel, args, kwargs, arch)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              spec, options)
    src = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(src, target=_target(arch), options=options.__dict__)


_USAGE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


def resource_usage(compiled) -> tuple[int, int, int, int]:
    """``(registers, stack, shared, local)`` of a compiled kernel, from cuobjdump."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([os.path.join(_bin_dir(), "cuobjdump"), "--dump-resource-usage",
                              f.name], capture_output=True, text=True, check=True).stdout
    m = _USAGE.search(out)
    if m is None:
        raise RuntimeError(f"cannot read the resource usage from cuobjdump's output:\n{out}")
    return tuple(int(g) for g in m.groups())


# The end of a tt.reduce op in the TTGIR: ``}) : (tensor<64x64xf32, #blocked>) -> ...``.
_REDUCE_OPERAND = re.compile(r"^\s*\}\) : \(tensor<([0-9x]+)x\w+, (#\w+)>\) ->", re.M)


def reduction_layouts(compiled) -> list[str]:
    """``shape: layout`` (the layout's definition in the TTGIR) of the operand of every
    ``tt.reduce``, in program order: two kernels whose reductions see equal shapes and
    layouts add their values in the same order."""
    ttgir = compiled.asm["ttgir"]
    aliases = dict(re.findall(r"^(#\w+) = (.*)$", ttgir, flags=re.M))
    return [f"{shape}: {aliases.get(name, name)}"
            for shape, name in _REDUCE_OPERAND.findall(ttgir)]


# ------------------------------------------------------------------------------- the cases

def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "BF16", torch.float32: "FP32"}[dtype]


def _stacks(layout: str, w_dtype, p_dtype, count: int = 2):
    """``(weights, factors, projections, offset)`` of ``count`` stacks of two matrices."""
    def build(d, k, r, *, wide=None, transposed=False):
        ws = []
        for _ in range(count):
            if wide is not None:
                ws.append(torch.zeros(2, d, wide, dtype=w_dtype)[:, :, 3:3 + k])
            elif transposed:
                ws.append(torch.zeros(2, k, d, dtype=w_dtype).transpose(1, 2))
            else:
                ws.append(torch.zeros(2, d, k, dtype=w_dtype))
        us = [torch.zeros(2, d, r) for _ in range(count)]
        ps = [torch.zeros(k, r, dtype=p_dtype) for _ in range(count)]
        return ws, us, ps
    if layout == "misaligned":
        return (*build(37, 53, 7, wide=61), 2**33 + 5)
    if layout == "transposed":
        return (*build(128, 256, 64, transposed=True), 0)
    r = {"aligned": 64, "r=7": 7, "r=1": 1}[layout]
    return (*build(128, 256, r), 0)


UPDATE_LAYOUTS = ("aligned", "misaligned", "r=7", "r=1")


def update_variants():
    """``(w_dtype, p_dtype, stochastic, layout, decay)`` of every update case: every dtype
    and rounding in the four layouts, with and without decay; transposed storage for BF16 P,
    with and without decay."""
    for w_dtype in WEIGHT_DTYPES:
        for p_dtype in PROJECTION_DTYPES:
            for stochastic in (True, False) if w_dtype == torch.bfloat16 else (False,):
                for decay in (False, True):
                    for layout in UPDATE_LAYOUTS:
                        yield w_dtype, p_dtype, stochastic, layout, decay
                    if p_dtype == torch.bfloat16 and (stochastic or w_dtype == torch.float32):
                        yield w_dtype, p_dtype, stochastic, "transposed", decay


def update_case_name(w_dtype, p_dtype, stochastic, layout, decay) -> str:
    rounding = ("stochastic" if stochastic else
                "nearest" if w_dtype == torch.bfloat16 else "plain")
    return (f"W {_short(w_dtype)}, P {_short(p_dtype)}, {rounding}, {layout}"
            f"{', decay' if decay else ''}")


def update_case(w_dtype, p_dtype, stochastic, layout, decay) -> list[tuple]:
    """The launches of one update case (update kernel, ordered sum of the norms)."""
    weights, factors, projections, offset = _stacks(layout, w_dtype, p_dtype)
    count = len(weights)
    coefs = torch.zeros(count, 2)
    return K.update_launches(weights, factors, projections, coefs,
                             torch.zeros(count, 2) if decay else None, [0] * count,
                             [offset] * count, [w.shape[2] for w in weights], stochastic,
                             torch.zeros(count, 2))


def update_cases():
    """``(case name, launches)`` for every configuration of the fused update."""
    for variant in update_variants():
        yield update_case_name(*variant), update_case(*variant)


def norm_cases():
    """``(case name, launches)`` of ``sum_squares``: the update kernel in norm-only mode."""
    for w_dtype in WEIGHT_DTYPES:
        for layout in ("aligned", "misaligned", "transposed"):
            weights = _stacks(layout, w_dtype, torch.bfloat16)[0]
            yield (f"norm, W {_short(w_dtype)}, {layout}",
                   K.sum_squares_launches(weights, torch.zeros(len(weights), 2)))


def rounding_cases():
    """``(case name, launches)`` of the rounding and random-word kernels."""
    for name, numel, offset in [("aligned", 4096, 0), ("misaligned", 4099, 2**33 + 5),
                                ("one element", 1, 7)]:
        x = torch.zeros(numel)
        out = torch.zeros(numel, dtype=torch.bfloat16)
        yield f"rounding, {name}", K.stochastic_round_launches(out, x, 0, offset)
        yield (f"random words, {name}",
               K.random_words_launches(torch.zeros(numel, dtype=torch.int32), 0, "x", offset))


def gaussian_cases():
    """``(case name, launches)`` of the Gaussian kernel (P refresh), even and odd rank."""
    for name, k, r in [("r=64", 4096, 64), ("odd r", 1000, 37)]:
        h = (r + 1) // 2
        yield f"gaussian, {name}", K.gaussian_launches(torch.zeros(3, k, 2 * h), k, h, [0, 1, 2])


def projection_cases():
    """``(case name, launches)`` of the Gram kernel (sketch norms, orthonormalisation) and of
    the sketch-norm kernels, aligned and odd shapes."""
    for dtype in PROJECTION_DTYPES:
        for name, k, r in [("aligned", 256, 64), ("odd", 53, 7)]:
            ps = [torch.zeros(k, r, dtype=dtype) for _ in range(2)]
            yield (f"gram, P {_short(dtype)}, {name}",
                   K.gram_launches(ps, torch.zeros(2, r, r)))
            if dtype == torch.float32:
                yield (f"gram FP64, {name}",
                       K.gram_launches(ps, torch.zeros(2, r, r, dtype=torch.float64),
                                       fp64=True))
    for name, d, k, r in [("aligned", 128, 256, 64), ("odd", 37, 53, 7)]:
        cs = [torch.zeros(2, d, r) for _ in range(2)]
        ps = [torch.zeros(k, r, dtype=torch.bfloat16) for _ in range(2)]
        yield (f"sketch stats, {name}",
               K.sketch_stats_launches(cs, ps, torch.zeros(2, 2),
                                       torch.zeros(2, 2, dtype=torch.bool)))


# (d, r): sizes and strides multiples of 16, or 1, or neither (the classes Triton specialises).
ADAM_LAYOUTS = {"aligned": (128, 64), "r=7": (128, 7), "r=1": (128, 1), "odd d": (37, 64),
                "odd d, r=7": (37, 7), "odd d, r=1": (37, 1), "misaligned": (37, 7)}


def adam_stacks(layout: str, count: int = 2):
    """``(sketches, exp_avgs, exp_avg_sqs)`` of ``count`` stacks of two matrices; the
    misaligned layout's tensors start one element into their storage (unaligned pointers)."""
    d, r = ADAM_LAYOUTS[layout]
    skip = 1 if layout == "misaligned" else 0

    def make(*shape):
        n = math.prod(shape)
        return [torch.zeros(n + skip)[skip:].view(shape) for _ in range(count)]
    return make(2, d, r), make(2, d, r), make(2, d)


def adam_cases():
    """``(case name, launches)`` of RowAdam's moment kernel in every layout (``maximize`` is
    a value, not a specialisation)."""
    for layout in ADAM_LAYOUTS:
        yield (f"row adam, {layout}",
               K.row_adam_launches(*adam_stacks(layout), torch.ones(2, 2, dtype=torch.bool),
                                   torch.ones(2, 2, dtype=torch.int64), 0.9, 0.999, 1e-8, False))


#: Output dtypes of a projection.
REFRESH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def refresh_cases():
    """``(case name, launches)`` of the P refresh for every kind and output dtype: the
    Rademacher and scaled Gaussian kernels, and the orthonormal kind in one CholeskyQR pass
    (k >= 4 r) and in CholeskyQR3 (k < 4 r). Their kernels specialise no size or stride
    (only dtypes and unit strides), so one shape of each stands for all."""
    for dtype in REFRESH_DTYPES:
        name = str(dtype).removeprefix("torch.")
        for kind, (k, r) in [("rademacher", (53, 7)), ("gaussian", (53, 7)),
                             ("orthonormal", (53, 7)), ("orthonormal", (20, 7))]:
            outs = [torch.zeros(k, r, dtype=dtype) for _ in range(2)]
            label = f"{kind}{'' if one_pass(k, r) else ' k < 4r'}"
            yield f"refresh, {label}, {name}", K.projection_launches(outs, kind, [1, 2])


def all_cases():
    return [*update_cases(), *norm_cases(), *rounding_cases(), *gaussian_cases(),
            *projection_cases(), *adam_cases(), *refresh_cases()]


def supported_archs(archs=ARCHS) -> list[int]:
    """The architectures of ``archs`` that this wheel's ptxas compiles for."""
    (_, launches), = list(rounding_cases())[:1]
    kernel, _grid, args, kwargs = launches[0]
    supported = []
    for arch in archs:
        try:
            compile_launch(kernel, args, kwargs, arch)
        except Exception:  # noqa: BLE001 - ptxas or the backend refusing the architecture
            continue
        supported.append(arch)
    return supported


def distinct_launches(cases) -> list[tuple[str, tuple]]:
    """``(case name, launch)`` for each distinct specialisation among the cases' launches
    (the first case that needs it names it)."""
    seen, out = set(), []
    for case, launches in cases:
        for launch in launches:
            kernel, _grid, args, kwargs = launch
            key = specialization(kernel, args, kwargs)
            if key not in seen:
                seen.add(key)
                out.append((case, launch))
    return out


def all_usage(archs=ARCHS) -> list[Usage]:
    """Compile every distinct launch of every case for every architecture; a Usage each."""
    rows = []
    launches = distinct_launches(all_cases())
    for arch in archs:
        for case, (kernel, _grid, args, kwargs) in launches:
            compiled = compile_launch(kernel, args, kwargs, arch)
            regs, stack, shared, local = resource_usage(compiled)
            rows.append(Usage(kernel.__name__.strip("_"), arch, case,
                              kwargs.get("num_warps", 4), regs, stack, local, shared))
    return rows
