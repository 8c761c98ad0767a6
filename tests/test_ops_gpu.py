"""rgc.ops.triton compiled on a CUDA GPU. Skips without CUDA or Triton, or under TRITON_INTERPRET=1.

(tests/test_ops_triton.py loads the kernels interpreted only for its own duration and compiled
again afterwards, so both files can run in one process.)
"""

import math
import os

import pytest
import torch
import torch.nn as nn

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("TRITON_INTERPRET=1: these tests need compiled kernels", allow_module_level=True)

import rgc  # noqa: E402
from rgc.ops import reference as R  # noqa: E402
from rgc.ops import triton as T  # noqa: E402
from rgc.ops import triton_buffers  # noqa: E402
from tests.bf16_checks import assert_close_bf16, bits16  # noqa: E402
from tests.launches import CountLaunches  # noqa: E402

if T.INTERPRETED:
    pytest.skip("the kernels are loaded interpreted in this process", allow_module_level=True)

CUDA = torch.device("cuda")


def stacks(count, e, d, k, r, *, w_dtype=torch.bfloat16, p_dtype=torch.bfloat16, seed=0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    ws = [torch.randn(e, d, k, generator=g, device=CUDA).to(w_dtype) for _ in range(count)]
    us = [torch.randn(e, d, r, generator=g, device=CUDA) for _ in range(count)]
    ps = [(torch.randn(k, r, generator=g, device=CUDA) / math.sqrt(r)).to(p_dtype)
          for _ in range(count)]
    return ws, us, ps


def dense(w, u, p, coef, decay, *, seed, offset, row_length):
    """float64 ``W (1 - decay) - coef U P^T`` per matrix, once to FP32, then rounded on the
    CPU by the reference with the bits of offset + (e d + i) row_length + j."""
    e, d, k = w.shape
    factor = (1.0 - decay.float()).double().view(e, 1, 1)
    new = (w.double() * factor - coef.double().view(e, 1, 1) * (u.double() @ p.double().t()))
    new = new.float()
    if w.dtype == torch.float32:
        return new
    out = torch.empty(e, d, k, dtype=torch.bfloat16)
    new_cpu = new.cpu()
    if row_length == k:  # flat index offset + (e d + i) k + j: one call
        R.stochastic_round_(out, new_cpu, seed, offset)
    else:
        for i in range(e):
            for row in range(d):
                R.stochastic_round_(out[i, row], new_cpu[i, row], seed,
                                    offset + (i * d + row) * row_length)
    return out.to(CUDA)


def test_rounding_and_words_bit_identical_with_the_reference():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-2**31, 2**31, (1_000_003,), generator=g).to(torch.int32).view(
        torch.float32)
    x[::3] = torch.randn(len(x[::3]), generator=g)
    for seed, offset in [(0, 0), (123, 2**32 - 500_000), (2**62, 2**40)]:
        ref = torch.empty(x.shape, dtype=torch.bfloat16)
        R.stochastic_round_(ref, x, seed, offset)
        out = torch.empty(x.shape, dtype=torch.bfloat16, device=CUDA)
        T.stochastic_round_(out, x.to(CUDA), seed, offset)
        nan = torch.isnan(ref.float())
        assert torch.equal(torch.isnan(out.cpu().float()), nan)
        assert torch.equal(bits16(out.cpu())[~nan], bits16(ref)[~nan])
        words = T.random_words(1_000_003, seed, "x", offset, CUDA)
        assert torch.equal(words.cpu(), R.random_words(1_000_003, seed, "x", offset, "cpu"))


@pytest.mark.parametrize("k,r", [(4096, 64), (1000, 37), (6144, 256)])
def test_gaussians_have_the_reference_bits(k, r):
    seeds = [k + r, 1, 2**62]
    got = T.gaussian_matrices(k, r, seeds, CUDA)
    assert torch.equal(got.cpu(), R.gaussian_matrices(k, r, seeds, "cpu"))


def test_orthonormalize_on_cuda_matches_the_cpu():
    g = R.gaussian_matrices(2048, 64, [5, 6], "cpu")
    for gram_fp64 in (False, True):
        on_gpu = T.orthonormalize(g.to(CUDA), math.sqrt(32), gram_fp64)
        on_cpu = R.orthonormalize(g, math.sqrt(32), gram_fp64)
        torch.testing.assert_close(on_gpu.cpu().double(), on_cpu.double(), rtol=0,
                                   atol=2e-6 * math.sqrt(32))


@pytest.mark.parametrize("e,d,k,r", [(1, 1000, 3000, 64), (2, 4096, 1000, 100), (1, 257, 4099, 7),
                                     (3, 300, 500, 256), (1, 129, 77, 1)])
@pytest.mark.parametrize("p_dtype", [torch.bfloat16, torch.float32])
def test_update_matches_float64(e, d, k, r, p_dtype):
    ws, us, ps = stacks(2, e, d, k, r, p_dtype=p_dtype)
    before = [w.clone() for w in ws]
    coefs = torch.full((2, e), 0.05, device=CUDA)
    decays = torch.full((2, e), 0.01, device=CUDA)
    T.lowrank_update_(ws, us, ps, coefs, decays, [3, 4], [11, 2**33], [k, k], True, 128, None)
    torch.cuda.synchronize()
    for m in range(2):
        assert_close_bf16(ws[m], dense(before[m], us[m], ps[m], coefs[m], decays[m], seed=3 + m,
                                       offset=[11, 2**33][m], row_length=k))


def test_fp32_weights_transposed_and_column_views():
    ws, us, ps = stacks(1, 2, 500, 700, 64, w_dtype=torch.float32)
    ref = ws[0].double() - 0.3 * (us[0].double() @ ps[0].double().t())
    scale = ws[0].double().abs() + 0.3 * (us[0].double().abs() @ ps[0].double().abs().t())
    T.lowrank_update_(ws, us, ps, torch.full((1, 2), 0.3, device=CUDA), None, [0], [0], [700],
                      True, 128, None)
    assert ((ws[0].double() - ref).abs() <= 2.0**-24 * 68 * scale).all()

    wide = torch.randn(2, 500, 760, device=CUDA).bfloat16()
    transposed = torch.randn(2, 700, 500, device=CUDA).bfloat16().transpose(1, 2)
    views = [wide[:, :, 30:730], transposed]
    before = [v.clone() for v in views]
    coefs = torch.full((2, 2), 0.05, device=CUDA)
    T.lowrank_update_(views, [us[0], us[0]], [ps[0], ps[0]], coefs, None, [2, 3], [30, 0],
                      [760, 700], True, 128, None)
    zero = torch.zeros(2, device=CUDA)
    assert_close_bf16(views[0], dense(before[0], us[0], ps[0], coefs[0], zero, seed=2,
                                      offset=30, row_length=760))
    assert_close_bf16(views[1], dense(before[1], us[0], ps[0], coefs[1], zero, seed=3,
                                      offset=0, row_length=700))


def test_update_allocates_only_its_partial_sums_and_table():
    d, k, r = 4096, 4096, 128
    ws, us, ps = stacks(2, 1, d, k, r)
    coefs, sq = torch.full((2, 1), 1e-3, device=CUDA), torch.empty(2, 1, device=CUDA)
    T.lowrank_update_(ws, us, ps, coefs, None, [0, 1], [0, 0], [k, k], True, 128, sq)  # compile
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    T.lowrank_update_(ws, us, ps, coefs, None, [0, 1], [0, 0], [k, k], True, 128, sq)
    torch.cuda.synchronize()
    # One FP32 partial sum per 64 x 64 tile and the int64 table (the caching allocator rounds
    # each to 512 bytes); not one FP32 row of H per tile, let alone the torch path's chunk.
    partials = 2 * T.update_programs(d, k) * 4
    allowed = -(-partials // 512) * 512 + 512
    assert torch.cuda.max_memory_allocated() - base <= allowed
    torch.cuda.reset_peak_memory_stats()
    R.lowrank_update_(ws, us, ps, coefs, None, [0, 1], [0, 0], [k, k], True, 128, None)
    assert torch.cuda.max_memory_allocated() - base >= 128 * k * 4


@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32])
def test_device_coefs_and_sq_norms_without_host_sync(w_dtype):
    ws, us, ps = stacks(3, 2, 1000, 3000, 64, w_dtype=w_dtype)
    coefs = torch.full((3, 2), 0.5, device=CUDA)
    decays = torch.full((3, 2), 0.01, device=CUDA)
    sq = torch.empty(3, 2, device=CUDA)
    args = (coefs, decays, [3, 4, 5], [7, 8, 9], [3000] * 3, True, 128, sq)
    T.lowrank_update_([w.clone() for w in ws], us, ps, *args)  # compile first: it may sync
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        T.lowrank_update_(ws, us, ps, *args)
        norms = T.sum_squares(ws, 128)
        T.sketch_stats(us, ps)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = torch.stack([(w.double() ** 2).sum(dim=(1, 2)) for w in ws]).float()
    torch.testing.assert_close(sq, want, rtol=1e-6, atol=0)
    # sum_squares: the update's tiles and reduction order, the same bits
    assert torch.equal(norms.view(torch.int32), sq.view(torch.int32))


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "column slice", "odd"])
def test_sum_squares_has_the_bits_of_the_update(layout):
    build = {
        "contiguous": lambda: torch.randn(2, 4096, 1024, device=CUDA).bfloat16(),
        "transposed": lambda: torch.randn(2, 1024, 4096, device=CUDA).bfloat16().transpose(1, 2),
        "column slice": lambda: torch.randn(2, 4096, 1030, device=CUDA).bfloat16()[:, :, 3:1027],
        "odd": lambda: torch.randn(2, 1001, 999, device=CUDA).bfloat16(),
    }[layout]
    ws = [build(), build()]
    d, k = ws[0].shape[1:]
    us = [torch.randn(2, d, 48, device=CUDA) for _ in ws]
    ps = [torch.randn(k, 48, device=CUDA).bfloat16() / 7 for _ in ws]
    row_lengths = [w.stride(1) if layout == "column slice" else k for w in ws]
    for p_parts in (ps, [p.float() for p in ps]):
        sq = torch.empty(2, 2, device=CUDA)
        T.lowrank_update_(ws, us, p_parts, torch.full((2, 2), 1e-3, device=CUDA),
                          torch.full((2, 2), 1e-4, device=CUDA), [1, 2], [0, 0], row_lengths,
                          True, 128, sq)
        assert torch.equal(T.sum_squares(ws, 128).view(torch.int32), sq.view(torch.int32))
        # and the CPU's norm of the same weights (float64 sums on both): one contract
        cpu = R.sum_squares([w.cpu() for w in ws], 128)
        assert torch.equal(cpu.view(torch.int32), sq.cpu().view(torch.int32))


def test_coef_zero_keeps_bits_with_nan_factors():
    ws, us, ps = stacks(1, 2, 300, 500, 32)
    ws[0][0, 0, :2] = torch.tensor([-0.0, 0.0])
    before = bits16(ws[0]).clone()
    us[0][:, 5, 3] = float("nan")
    ps[0][2, 1] = float("inf")
    sq = torch.empty(1, 2, device=CUDA)
    T.lowrank_update_(ws, us, ps, torch.zeros(1, 2, device=CUDA), None, [1], [0], [500], True,
                      128, sq)
    assert torch.equal(bits16(ws[0]), before)
    want = (ws[0].double() ** 2).sum(dim=(1, 2)).float()
    torch.testing.assert_close(sq[0], want, rtol=1e-6, atol=0)


def test_sketch_stats_match_float64():
    cs = [torch.randn(2, 4096, 64, device=CUDA) for _ in range(3)]
    ps = [torch.randn(1024, 64, device=CUDA).bfloat16() for _ in range(3)]
    cs[2][1, 7, 3] = float("inf")
    h2, finite = T.sketch_stats(cs, ps)
    assert finite.tolist() == [[True, True], [True, True], [True, False]]
    for m in range(3):
        for e in range(2):
            if finite[m, e]:
                want = ((cs[m][e].double() @ ps[m].double().t()) ** 2).sum().item()
                assert h2[m, e].item() == pytest.approx(want, rel=1e-5)


def test_compiled_launches_do_not_grow_with_the_number_of_stacks():
    def count(n):
        ws, us, ps = stacks(n, 1, 512, 1024, 32)
        coefs = torch.full((n, 1), 1e-3, device=CUDA)
        sq = torch.empty(n, 1, device=CUDA)
        T.lowrank_update_(ws, us, ps, coefs, None, list(range(n)), [0] * n, [1024] * n, True,
                          128, sq)  # compile
        with CountLaunches(device="cuda") as launches:
            T.lowrank_update_(ws, us, ps, coefs, None, list(range(n)), [0] * n, [1024] * n,
                              True, 128, sq)
            T.sketch_stats(us, ps)
        return launches

    two, four = count(2), count(4)
    assert two.triton == four.triton == 2 + 3
    assert two.total == four.total, (two.names, four.names)


@pytest.mark.parametrize("kind", ["orthonormal", "gaussian", "rademacher"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,r", [(4096, 64), (1000, 37), (3072, 256), (300, 128)])
def test_refresh_is_batch_invariant_on_the_device(kind, dtype, k, r, monkeypatch):
    # The trainer refreshes a group, a sync receiver one P: the same bits, whatever the
    # batch, its order and its chunks (300 x 128: CholeskyQR3). Against the CPU reference:
    # Gaussian and Rademacher bit for bit, orthonormal within its dtype's rounding.
    seeds = [7 * i + 1 for i in range(24)]

    def refresh(seeds_):
        outs = [torch.empty(k, r, dtype=dtype, device=CUDA) for _ in seeds_]
        T.make_projections_(outs, kind, seeds_)
        return outs

    batch, reverse = refresh(seeds), refresh(seeds[::-1])[::-1]
    monkeypatch.setattr(triton_buffers, "PROJECTION_CHUNK_BYTES",
                        5 * triton_buffers.projection_bytes(k, r))
    chunked = refresh(seeds)
    for i in (0, 5, 23):
        (alone,) = refresh([seeds[i]])
        for other in (batch[i], reverse[i], chunked[i]):
            assert torch.equal(other.view(torch.uint8), alone.view(torch.uint8))
        ref = torch.empty(k, r, dtype=dtype)
        R.make_projections_([ref], kind, [seeds[i]])
        if kind == "orthonormal":
            unit = 2**-8 if dtype == torch.bfloat16 else 2e-6
            torch.testing.assert_close(alone.cpu().double(), ref.double(), rtol=0,
                                       atol=4 * unit * math.sqrt(k / r))
        else:
            assert torch.equal(alone.cpu().view(torch.uint8), ref.view(torch.uint8))


def test_refresh_launches_do_not_grow_with_the_number_of_projections():
    def count(n):
        outs = [torch.empty(2048, 64, dtype=torch.bfloat16, device=CUDA) for _ in range(n)]
        T.make_projections_(outs, "orthonormal", list(range(n)))  # compile
        with CountLaunches(device="cuda") as launches:
            T.make_projections_(outs, "orthonormal", list(range(n)))
        return launches
    two, eight = count(2), count(8)
    assert two.triton == eight.triton == 4 and two.host_reads == 0
    assert two.total == eight.total, (two.names, eight.names)


@pytest.mark.parametrize("e,d,r", [(1, 4096, 64), (8, 1000, 37), (2, 300, 256)])
def test_row_adam_matches_the_reference(e, d, r):
    # m within one FP32 unit of its terms (0.1 here) of the CPU reference (a fused multiply-add
    # there too, but not in torch's scalar tail); v and U within 1e-6 relative (the mean's
    # order, torch's CPU sqrt), U also within 1e-6 absolute (U ~ 1; m may cancel).
    g = torch.Generator().manual_seed(d + r)
    sketches = [torch.randn(e, d, r, generator=g) for _ in range(3)]
    exp_avgs = [torch.randn(e, d, r, generator=g) * 0.1 for _ in range(3)]
    exp_avg_sqs = [torch.rand(e, d, generator=g) * 0.01 for _ in range(3)]
    active = torch.rand(3, e, generator=g) < 0.8
    steps = torch.randint(1, 10_000, (3, e), generator=g)
    gpu = [[t.to(CUDA) for t in ts] for ts in (sketches, exp_avgs, exp_avg_sqs)]
    with CountLaunches(device="cuda") as launches:
        T.row_adam_(*gpu, active.to(CUDA), steps.to(CUDA), 0.9, 0.999, 1e-8, True)
    assert launches.triton == 1
    R.row_adam_(sketches, exp_avgs, exp_avg_sqs, active, steps, 0.9, 0.999, 1e-8, True)
    for got, want in zip(gpu[1], exp_avgs):
        torch.testing.assert_close(got.cpu(), want, rtol=1.2e-7, atol=1e-8)
    for got, want in zip(gpu[0], sketches):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    for got, want in zip(gpu[2], exp_avg_sqs):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=0)


def test_optimizer_on_cuda_matches_the_torch_path(monkeypatch):
    assert rgc.ops.implementation_for_device(CUDA) == "triton"

    def train(impl):
        monkeypatch.setenv("RGC_IMPL", impl)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 512, bias=False), nn.Tanh(),
                              nn.Linear(512, 128, bias=False)).to(CUDA, torch.bfloat16)
        rgc.wrap(model, rank=32, targets=lambda name, m: isinstance(m, nn.Linear), seed=1)
        opt = rgc.RGCOptimizer(model.parameters(), lr=0.02, seed=5)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1)).to(CUDA,
                                                                                torch.bfloat16)
        for _ in range(3):
            opt.zero_grad()
            model(x).float().pow(2).mean().backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for a, b in zip(train("triton"), train("torch"), strict=True):
        assert_close_bf16(a, b)


@pytest.mark.parametrize("d,world", [(1000, 2), (37, 4), (4099, 8)])
def test_row_shards_with_their_offsets_have_the_bits_of_the_unsharded_update(d, world):
    """What FSDP2 ranks do on the GPU (rgc.distributed): each updates its own copy of its
    torch.chunk rows with rounding offset ``first_row * k``; together they have the bits of
    the unsharded update (the rounding bits and the FP32 products of a row do not depend on
    where a launch's rows start)."""
    k, r = 768, 64
    ws, us, ps = stacks(1, 1, d, k, r)
    coefs = torch.full((1, 1), 0.05, device=CUDA)
    decays = torch.full((1, 1), 0.01, device=CUDA)
    whole = ws[0].clone()
    T.lowrank_update_([whole], us, ps, coefs, decays, [7], [0], [k], True, 128, None)
    chunk = -(-d // world)
    pieces = []
    for start in range(0, d, chunk):
        rows = ws[0][:, start:start + chunk].clone()  # a rank's local shard
        T.lowrank_update_([rows], [us[0][:, start:start + chunk].clone()], ps, coefs, decays,
                          [7], [start * k], [k], True, 128, None)
        pieces.append(rows)
    assert torch.equal(bits16(torch.cat(pieces, dim=1)), bits16(whole))
    assert not torch.equal(bits16(whole), bits16(ws[0]))
