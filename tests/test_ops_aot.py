"""Every launch configuration of rgc.ops.triton compiles ahead of time without register spills.

No GPU needed: Triton's NVIDIA backend compiles for sm_80, sm_90 and sm_100 (where the
wheel's ptxas supports it) and cuobjdump from the wheel reads registers and stack bytes. A
spill needs a stack frame, so zero stack and zero local bytes mean spill-free. The launches
compiled are built by the launchers themselves (``*_launches`` in rgc.ops.triton) and bound
by Triton's own specialisation; equal specialisations are compiled once. The first run
compiles 318 kernels (106 per architecture: about 4 minutes of CPU time); with Triton's cache
(~/.triton/cache) later runs take 15-25 seconds.
"""

import importlib
import re
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tools/ is not installed


@pytest.fixture(scope="module")
def aot():
    """tools.aot with the kernels loaded compiled (not interpreted)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        kernels = sys.modules.get("rgc.ops.triton")
        if kernels is not None and kernels.INTERPRETED:
            importlib.reload(kernels)
        from tools import aot
        reason = aot.toolchain_missing()
        if reason is not None:
            pytest.skip(f"cannot compile ahead of time: {reason}")
        yield aot


@pytest.fixture(scope="module")
def compiled(aot):
    """``(case, kernel name, arch, num_warps, compiled)`` of every distinct launch."""
    archs = aot.supported_archs()
    assert {80, 90} <= set(archs), f"this Triton wheel cannot compile for sm_80/sm_90: {archs}"
    launches = aot.distinct_launches(aot.all_cases())
    return [(case, kernel.__name__.strip("_"), arch, kwargs.get("num_warps", 4),
             aot.compile_launch(kernel, args, kwargs, arch))
            for arch in archs for case, (kernel, _grid, args, kwargs) in launches]


@pytest.fixture(scope="module")
def usage(aot, compiled):
    return [aot.Usage(name, arch, case, warps, *_resources(aot, c))
            for case, name, arch, warps, c in compiled]


def _resources(aot, c):
    regs, stack, shared, local = aot.resource_usage(c)
    return regs, stack, local, shared


def test_no_configuration_spills(usage):
    spilled = [u for u in usage if u.stack or u.local]
    assert not spilled, "register spills (stack/local bytes > 0):\n" + "\n".join(map(str, spilled))


def test_every_configuration_was_compiled(aot, usage):
    archs = sorted({u.arch for u in usage})
    updates = [u for u in usage if u.kernel == "lowrank_update_kernel"
               and not u.case.startswith("norm")]
    assert len(updates) == len(archs) * len(list(aot.update_variants()))
    assert {u.kernel for u in usage} == {
        "lowrank_update_kernel", "finish_kernel", "stochastic_round_kernel",
        "random_words_kernel", "gaussian_kernel", "gram_kernel", "sketch_stats_kernel",
        "row_adam_kernel", "rademacher_kernel", "refresh_gram_kernel",
        "cholesky_inverse_kernel", "projection_product_kernel"}
    for u in updates:  # a cap the launcher sets, and ptxas honours
        assert u.registers <= aot.K.MAXNREG_MISALIGNED


def test_aligned_layouts_keep_two_programs_per_sm(usage):
    # 8 warps x <= 128 registers: two programs of the update fit on one SM's 64K registers.
    aligned = [u for u in usage if u.kernel == "lowrank_update_kernel"
               and re.search(r"\b(aligned|transposed)\b", u.case)
               and "misaligned" not in u.case and not u.case.startswith("norm")]
    assert aligned and all(u.registers <= 128 and u.num_warps == 8 for u in aligned)


@pytest.fixture(scope="module")
def compiled_keys(aot, compiled):
    return {aot.specialization(kernel, args, kwargs)
            for _case, (kernel, _grid, args, kwargs) in aot.distinct_launches(aot.all_cases())}


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_every_rank_runs_a_compiled_case(aot, compiled_keys, w_dtype, p_dtype):
    # For r = 1..512 on a model-shaped W, whatever the seed, offset and the coefficients'
    # layout, the JIT's key of each launch is one of the keys compiled above: no rank reaches
    # a kernel this file did not check. (Misaligned layouts: one representative each.)
    stochastic = w_dtype == torch.bfloat16
    weights = [torch.zeros(1, 96, 160, dtype=w_dtype) for _ in range(2)]
    for r in range(1, 513):
        factors = [torch.zeros(1, 96, r) for _ in weights]
        projections = [torch.zeros(160, r, dtype=p_dtype) for _ in weights]
        for decay in (None, torch.zeros(2, 1)):
            launches = aot.K.update_launches(
                weights, factors, projections, torch.zeros(2, 1), decay, [r, 3],
                [(2**33 + 5) * r, 7], [160] * 2, stochastic, torch.zeros(2, 1))
            for kernel, _grid, args, kwargs in launches:
                assert aot.specialization(kernel, args, kwargs) in compiled_keys, (r, decay)


@pytest.mark.parametrize("d", [96, 37])
def test_every_rank_runs_a_compiled_row_adam_case(aot, compiled_keys, d):
    # RowAdam's moment kernel for every r from 1 to 512 (aligned and odd d, whatever the
    # steps and activity tables and betas): its JIT key is one of the keys compiled above.
    for r in range(1, 513):
        stacks = ([torch.zeros(3, d, r)] * 2, [torch.zeros(3, d, r)] * 2, [torch.zeros(3, d)] * 2)
        for maximize in (False, True):
            for kernel, _grid, args, kwargs in aot.K.row_adam_launches(
                    *stacks, torch.ones(2, 3, dtype=torch.bool)[:, :3],
                    torch.full((2, 5), 7)[:, 1:4], 0.5, 0.25, 0.0, maximize):
                assert aot.specialization(kernel, args, kwargs) in compiled_keys, (d, r)


@pytest.mark.parametrize("kind", ["orthonormal", "gaussian", "rademacher"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_rank_runs_a_compiled_refresh_case(aot, compiled_keys, kind, dtype):
    # The P refresh for every r from 1 to 512: k = 2048 (one CholeskyQR pass), and k = 160
    # for the ranks at which k < 4 r (CholeskyQR3), every JIT key compiled above.
    shapes = [(2048, r) for r in range(1, 513)]
    if kind == "orthonormal":
        shapes += [(160, r) for r in range(41, 161)]
    for k, r in shapes:
        outs = [torch.zeros(k, r, dtype=dtype) for _ in range(2)]
        for kernel, _grid, args, kwargs in aot.K.projection_launches(outs, kind, [3, 2**40]):
            assert aot.specialization(kernel, args, kwargs) in compiled_keys, (k, r)


def test_norm_pass_reduces_in_the_update_order(compiled, aot):
    # sum_squares runs the update kernel with NORM_ONLY: per W layout and architecture, its
    # tile reduction must see the layout that every update of that W reduces in, and every
    # ordered sum reduces alike, so a recomputed norm has the update's bits.
    layouts = {}
    for case, name, arch, _warps, c in compiled:
        if name == "lowrank_update_kernel":
            w_layout = re.sub(r", (P \w+|stochastic|nearest|plain|decay)", "",
                              case.removeprefix("norm, ")).replace("r=7", "aligned")
            w_layout = w_layout.replace("r=1", "aligned")  # an aligned W, another rank
            layouts.setdefault((arch, w_layout), set()).add(tuple(aot.reduction_layouts(c)))
        elif name == "finish_kernel":
            layouts.setdefault((arch, "finish"), set()).add(
                tuple(aot.reduction_layouts(c))[:1])
    norm_keys = {key for key in layouts if key[1].split(", ")[-1] in
                 ("aligned", "misaligned", "transposed")}
    assert len(norm_keys) >= 2 * 3
    for key in norm_keys | {k for k in layouts if k[1] == "finish"}:
        assert len(layouts[key]) == 1 and all(layouts[key]), (key, layouts[key])


def test_gaussian_kernel_rounds_every_operation_like_the_reference(compiled):
    # The reference has no fused multiply-add and IEEE division and square root: the compiled
    # kernel must not contract a multiply and an add, nor approximate / or sqrt.
    gaussians = [c for _case, name, _arch, _w, c in compiled if name == "gaussian_kernel"]
    assert gaussians
    for c in gaussians:
        ptx = c.asm["ptx"]
        assert not re.search(r"\b(fma|mad)\.[a-z.]*f32", ptx)
        assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
        assert "div.approx" not in ptx and "div.full" not in ptx
        assert "sqrt.approx" not in ptx
