"""Ahead-of-time compilation of every kernel configuration, and the resources each one uses.

No GPU is needed: Triton's NVIDIA backend compiles for a named architecture with the
``ptxas`` that ships in the Triton wheel, and ``cuobjdump --dump-resource-usage`` (also in the
wheel) reads registers and stack bytes from the cubin. A configuration that spills registers
has a stack frame (spilled values live in local memory), so ``stack == 0`` means spill-free.

The launches compiled are the launcher's own (:func:`rgc.kernels._triton.update_launches`)
for small CPU tensors, bound by Triton's own argument specialisation (as a launch on a GPU
would bind them), so what is checked is what runs. The layouts cover the specialisations a
launch can meet: aligned (dimensions and strides multiples of 16), misaligned (odd
dimensions and strides, a column slice starting at an odd column, a flat offset past
2**32), an odd rank with an aligned W, and r = 1 (Triton turns arguments equal to 1 into
constants).

Used by ``tests/test_kernels_aot.py`` and ``benchmarks/gpu_kernels.py --registers``.
Requires the kernels to be loaded compiled, not interpreted (``TRITON_INTERPRET`` unset when
``rgc.kernels._triton`` was imported).
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import tempfile

import torch
import triton

from rgc.kernels import _triton as K

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
        from triton.runtime.jit import create_function_from_signature  # noqa: F401
    except ImportError as exc:
        return f"this Triton has no ahead-of-time compiler API ({exc})"
    if not hasattr(K._lowrank_update_kernel, "_pack_args"):
        return "this Triton's JIT has no _pack_args (the argument binding reused here)"
    for tool in ("ptxas", "cuobjdump"):
        if not os.access(os.path.join(_bin_dir(), tool), os.X_OK):
            return f"the Triton wheel ships no {tool} in {_bin_dir()}"
    return None


def _target(arch: int):
    from triton.backends.compiler import GPUTarget
    return GPUTarget("cuda", arch, 32)


def _bind(kernel, args: tuple, kwargs: dict, arch: int):
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(_target(arch))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    kwargs = dict(kwargs, debug=False)
    return backend, kwargs, *binder(*args, **kwargs)


def specialization(kernel, args: tuple, kwargs: dict, arch: int = 90) -> str:
    """The JIT's key for a launch: launches with equal keys run the same compiled kernel."""
    _, _, _, spec, options = _bind(kernel, args, kwargs, arch)
    return repr((spec, sorted(options.items())))


def compile_launch(kernel, args: tuple, kwargs: dict, arch: int):
    """Compile one launch ``kernel[grid](*args, **kwargs)`` for ``sm_<arch>``, as the JIT would."""
    from triton.compiler import ASTSource

    backend, kwargs, bound_args, specialization, options = _bind(kernel, args, kwargs, arch)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
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


def _layouts():
    """``(name, weight, sketch, projection, offset)`` builders for each layout, given dtypes."""
    def aligned(w_dtype, p_dtype, r=64):
        return (torch.zeros(128, 256, dtype=w_dtype), torch.zeros(128, r),
                torch.zeros(256, r, dtype=p_dtype), 0)

    def misaligned(w_dtype, p_dtype):
        wide = torch.zeros(37, 61, dtype=w_dtype)
        return (wide[:, 3:56], torch.zeros(37, 7), torch.zeros(53, 7, dtype=p_dtype),
                2**33 + 5)

    def odd_rank(w_dtype, p_dtype):
        return aligned(w_dtype, p_dtype, r=7)

    def rank_one(w_dtype, p_dtype):
        return aligned(w_dtype, p_dtype, r=1)

    return [("aligned", aligned), ("misaligned", misaligned), ("r=7", odd_rank),
            ("r=1", rank_one)]


def update_cases():
    """``(case name, launches)`` for every configuration of the fused update and layout."""
    for w_dtype in WEIGHT_DTYPES:
        for p_dtype in PROJECTION_DTYPES:
            roundings = (True, False) if w_dtype == torch.bfloat16 else (False,)
            for stochastic in roundings:
                rounding = ("stochastic" if stochastic else
                            "nearest" if w_dtype == torch.bfloat16 else "plain")
                for layout, build in _layouts():
                    weight, sketch, projection, offset = build(w_dtype, p_dtype)
                    d, k = weight.shape
                    partials = torch.zeros(K.update_programs(d, k))
                    launches = K.update_launches(
                        weight, sketch, projection, torch.zeros(()), partials,
                        torch.zeros(()), seed=0, offset=offset,
                        stochastic_rounding=stochastic)
                    name = (f"W {_short(w_dtype)}, P {_short(p_dtype)}, {rounding}, "
                            f"{layout}")
                    yield name, launches


def rounding_cases():
    """``(case name, launches)`` of the rounding kernel for aligned and misaligned sizes."""
    for name, numel, offset in [("aligned", 4096, 0), ("misaligned", 4099, 2**33 + 5),
                                ("one element", 1, 7)]:
        x = torch.zeros(numel)
        out = torch.zeros(numel, dtype=torch.bfloat16)
        yield f"rounding, {name}", K.stochastic_round_launches(out, x, seed=0, offset=offset)


def gaussian_cases():
    """``(case name, launches)`` of the Gaussian kernel (P refresh), even and odd rank."""
    for name, k, r in [("r=64", 4096, 64), ("odd r", 1000, 37)]:
        half = (r + 1) // 2
        g = torch.zeros(k, 2 * half)
        yield f"gaussian, {name}", K.gaussian_launches(g, k, half, seed=0)


def _short(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "BF16", torch.float32: "FP32"}[dtype]


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


def all_usage(archs=ARCHS) -> list[Usage]:
    """Compile every launch of every case for every architecture; one :class:`Usage` each."""
    rows = []
    cases = list(update_cases()) + list(rounding_cases()) + list(gaussian_cases())
    for arch in archs:
        seen = set()
        for case, launches in cases:
            for kernel, _grid, args, kwargs in launches:
                if kernel is K._sum_kernel:  # the same for every case
                    if kernel in seen:
                        continue
                    seen.add(kernel)
                    case = "sum of partials"
                compiled = compile_launch(kernel, args, kwargs, arch)
                regs, stack, shared, local = resource_usage(compiled)
                rows.append(Usage(kernel.__name__.strip("_"), arch, case,
                                  kwargs.get("num_warps", 4), regs, stack, local, shared))
    return rows
