"""Every launch configuration of rgc.kernels compiles ahead of time without register spills.

No GPU needed: Triton's NVIDIA backend compiles for sm_80, sm_90 and sm_100 (where the
wheel's ptxas supports it) and cuobjdump from the wheel reads registers and stack bytes. A
spill needs a stack frame, so zero stack and zero local bytes mean spill-free. The launches
compiled are built by the launcher itself (rgc.kernels._triton.update_launches) and bound by
Triton's own specialisation. The first run compiles 84 kernels (about two minutes on two
busy cores); with Triton's cache (~/.triton/cache) later runs take seconds.
"""

import importlib
import re
import sys

import pytest
import torch

pytest.importorskip("triton")


@pytest.fixture(scope="module")
def aot():
    """rgc.kernels._aot with the kernels loaded compiled (not interpreted)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        backend = sys.modules.get("rgc.kernels._triton")
        if backend is not None and backend.INTERPRETED:
            importlib.reload(backend)
        from rgc.kernels import _aot
        reason = _aot.toolchain_missing()
        if reason is not None:
            pytest.skip(f"cannot compile ahead of time: {reason}")
        yield _aot


@pytest.fixture(scope="module")
def usage(aot):
    archs = aot.supported_archs()
    assert {80, 90} <= set(archs), f"this Triton wheel cannot compile for sm_80/sm_90: {archs}"
    return aot.all_usage(archs)


def test_no_configuration_spills(usage):
    spilled = [u for u in usage if u.stack or u.local]
    assert not spilled, "register spills (stack/local bytes > 0):\n" + "\n".join(map(str, spilled))


def test_every_configuration_was_compiled(aot, usage):
    archs = sorted({u.arch for u in usage})
    updates = [u for u in usage if u.kernel == "lowrank_update_kernel"]
    # W BF16 x P {BF16, FP32} x {stochastic, nearest} + W FP32 x P {BF16, FP32}, 4 layouts.
    assert len(updates) == len(archs) * 6 * 4
    assert {u.kernel for u in usage} == {"lowrank_update_kernel", "sum_kernel",
                                         "stochastic_round_kernel", "gaussian_kernel"}
    for u in updates:  # a cap the launcher sets, and ptxas honours
        assert u.registers <= aot.K.MAXNREG_MISALIGNED


def test_aligned_layouts_keep_two_programs_per_sm(usage, aot):
    # 8 warps x <= 128 registers: two programs of the update fit on one SM's 64K registers.
    aligned = [u for u in usage if u.kernel == "lowrank_update_kernel" and "aligned" in u.case
               and "misaligned" not in u.case]
    assert aligned and all(u.registers <= 128 and u.num_warps == 8 for u in aligned)


def _cases_by_key(aot, dtypes_stochastic):
    return {aot.specialization(kernel, args, kwargs)
            for case, launches in aot.update_cases()
            for kernel, _grid, args, kwargs in launches[:1]
            if case.startswith(dtypes_stochastic)}


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_every_rank_runs_a_compiled_case(aot, w_dtype, p_dtype):
    # For r = 1..512 on a model-shaped W, whatever the seed and offset, the JIT's key of the
    # launch is one of the keys compiled above: no rank reaches a kernel this file did not
    # check. (Misaligned layouts are checked through one representative each.)
    name = {torch.bfloat16: "BF16", torch.float32: "FP32"}
    stochastic = w_dtype == torch.bfloat16
    prefix = (f"W {name[w_dtype]}, P {name[p_dtype]}, "
              f"{'stochastic' if stochastic else 'plain'}")
    compiled = _cases_by_key(aot, prefix)
    K = aot.K
    for r in range(1, 513):
        weight = torch.zeros(96, 160, dtype=w_dtype)
        d, k = weight.shape
        launches = K.update_launches(
            weight, torch.zeros(d, r), torch.zeros(k, r, dtype=p_dtype), torch.zeros(()),
            torch.zeros(K.update_programs(d, k)), None, seed=r, offset=(2**33 + 5) * r,
            stochastic_rounding=stochastic)
        kernel, _grid, args, kwargs = launches[0]
        assert aot.specialization(kernel, args, kwargs) in compiled, r


def test_gaussian_kernel_rounds_every_operation_like_the_cpu(aot):
    # The CPU definition has no fused multiply-add and IEEE division and square root: the
    # compiled kernel must not contract a multiply and an add, nor approximate / or sqrt.
    for arch in aot.supported_archs():
        for _case, launches in aot.gaussian_cases():
            kernel, _grid, args, kwargs = launches[0]
            ptx = aot.compile_launch(kernel, args, kwargs, arch).asm["ptx"]
            assert not re.search(r"\b(fma|mad)\.[a-z.]*f32", ptx)
            assert "div.rn.f32" in ptx and "sqrt.rn.f32" in ptx
            assert "div.approx" not in ptx and "div.full" not in ptx
            assert "sqrt.approx" not in ptx
