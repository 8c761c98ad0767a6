"""Data parallel and FSDP2 training on 2 CPU processes (gloo).

Each multi-process test spawns two fresh processes that write their results to files; the
assertions run here, against a single-process run on the whole batch and against plain float64
formulas.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

import rgc
from rgc.distributed import DistributedRGCOptimizer, all_reduce_sketches, check_seeds
from rgc.updates import apply_lowrank_update_
from tests.test_step_sync import CountSyncs

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")

WORLD = 2
RANK = 4
LR = 1e-2
STEPS = 3
BATCH = 8
TIMEOUT_S = 300  # a hang guard; a run takes ~20 s on 2 idle cores


class Net(nn.Module):
    """Two BF16 compressed layers (37 rows: FSDP pads the last shard) and an FP32 head."""

    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(24, 37, bias=False)
        self.down_proj = nn.Linear(37, 16, bias=False)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        return self.head(self.down_proj(torch.tanh(self.up_proj(x))).float())


def build(init_seed: int = 0, wrap_seed: int = 3) -> Net:
    torch.manual_seed(init_seed)
    net = Net()
    net.up_proj.bfloat16()
    net.down_proj.bfloat16()
    return rgc.wrap(net, RANK, targets=["up_proj", "down_proj"], seed=wrap_seed,
                    freeze_others=False)


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 24, generator=gen).bfloat16(),
            torch.randn(BATCH, 5, generator=gen))


def loss_on(net, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    x, y = batch(step)
    share = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
    return (net(x[share]) - y[share]).square().mean()


def full_state(net) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}


# ---------------------------------------------------------------- process plumbing


def _entry(fn, rank, out_dir, args):
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=WORLD)
        fn(rank, Path(out_dir), *args)
        dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def spawn(fn, out_dir: Path, *args) -> None:
    """Run ``fn(rank, out_dir, *args)`` on WORLD fresh processes joined by a gloo group."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "store").unlink(missing_ok=True)
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_entry, args=(fn, r, str(out_dir), args)) for r in range(WORLD)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(TIMEOUT_S)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    errors = [f.read_text() for f in sorted(out_dir.glob("error*.txt"))]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]


class CountCollectives:
    """Counts the bytes of the tensors passed to all_reduce / reduce_scatter (per call site)."""

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._saved = {}

    def __enter__(self):
        for name in ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor"):
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                tensor = args[0] if _name == "all_reduce" else args[1]
                self.calls.append((_name, tensor.numel() * tensor.element_size()))
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


# ---------------------------------------------------------------- workers


def _train_worker(rank: int, out: Path, mode: str) -> None:
    """Train STEPS steps; for FSDP2 once without and once with resharding after forward."""
    if mode == "dp":
        _train(rank, out, "dp", build())
        return
    from torch.distributed.fsdp import fully_shard

    for name, reshard in (("fsdp", False), ("fsdp_reshard", True)):
        net = build()
        fully_shard(net.head, reshard_after_forward=True)
        fully_shard(net, reshard_after_forward=reshard)
        _train(rank, out, name, net)


def _train(rank: int, out: Path, name: str, net: nn.Module) -> None:
    opt = DistributedRGCOptimizer(net.parameters(), lr=LR, seed=5)
    record = {"pre": [], "post": [], "bytes": [], "largest": 0, "syncs": []}
    for step in range(STEPS):
        record["pre"].append(full_state(net))
        loss = loss_on(net, step, rank, WORLD)
        with rgc.memory.track() as in_backward:
            loss.backward()
        if name == "dp" and step == 0:
            all_reduce_sketches(net)
            record["sketch"] = net.up_proj.sketch.clone()
            record["projection"] = net.up_proj.projection.clone()
        with CountCollectives() as count, rgc.memory.track() as in_step, CountSyncs() as syncs:
            opt.step()
        opt.zero_grad()
        record["bytes"].append(count.calls)
        record["syncs"].append(dict(syncs.syncs))
        record["largest"] = max([record["largest"]] + [
            math.prod(a.shape) for a in in_backward.allocations + in_step.allocations])
        record["post"].append(full_state(net))
    if name == "dp":  # DDP's constructor and backward are collective: every rank runs them
        record["ddp_bytes"] = _dense_ddp_bytes()
    torch.save(record, out / f"{name}{rank}.pt")


def _dense_ddp_bytes() -> int:
    """Bytes DDP all-reduces per step for the same (uncompressed, BF16) target layers."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    torch.manual_seed(0)
    net = Net()
    net.up_proj.bfloat16()
    net.down_proj.bfloat16()
    net.head.requires_grad_(False)
    ddp = nn.parallel.DistributedDataParallel(net)
    sent = [0]

    def hook(state, bucket):
        sent[0] += bucket.buffer().numel() * bucket.buffer().element_size()
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(dist.group.WORLD, hook)
    x, y = batch(0)
    (ddp(x[:BATCH // WORLD]) - y[:BATCH // WORLD]).square().mean().backward()
    return sent[0]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("train")
    results = {}
    for mode, names in (("dp", ["dp"]), ("fsdp", ["fsdp", "fsdp_reshard"])):
        spawn(_train_worker, out / mode, mode)
        for name in names:
            results[name] = [torch.load(out / mode / f"{name}{r}.pt") for r in range(WORLD)]
    return results


# ---------------------------------------------------------------- reference and bounds


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in BF16 ulps between same-sign BF16 tensors (difference of bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def single_process_steps(pre_states: list[dict]) -> list[dict]:
    """Single-process RGCOptimizer on the whole batch, each step started from ``pre_states[s]``."""
    net = build()
    opt = rgc.RGCOptimizer(net.parameters(), lr=LR, seed=5)
    posts = []
    for step, pre in enumerate(pre_states):
        with torch.no_grad():
            for k, v in net.state_dict().items():
                v.copy_(pre[k])
        loss_on(net, step).backward()
        opt.step()
        opt.zero_grad()
        posts.append(full_state(net))
    return posts


def assert_matches_single_process(record: list[dict]) -> None:
    """The bound documented in docs/distributed.md.

    Per step, from the same weights: the sketch is summed in a different order, an FP32 change
    of about 1e-8 relative, so a BF16 compressed weight can only differ where stochastic rounding
    falls the other way: by at most 1 ulp, in a tiny fraction of elements (expected none at this
    size). FP32 parameters (the head) differ by FP32 rounding only.
    """
    pre = record[0]["pre"]
    reference = single_process_steps(pre)
    for step, ref in enumerate(reference):
        for r in range(1, WORLD):
            for k, v in record[r]["post"][step].items():
                assert torch.equal(v, record[0]["post"][step][k]), (step, k, "ranks differ")
        got = record[0]["post"][step]
        for k in ("up_proj.weight", "down_proj.weight"):
            ulps = bf16_ulps(got[k], ref[k])
            assert int(ulps.max()) <= 1, (step, k, int(ulps.max()))
            assert int((ulps > 0).sum()) <= max(1, ulps.numel() // 100), (step, k)
            assert not torch.equal(got[k], pre[step][k]), "the weight did not move"
        for k in ("head.weight", "head.bias"):
            moved = (ref[k] - pre[step][k]).abs().max()
            torch.testing.assert_close(got[k], ref[k], rtol=0, atol=float(moved) * 1e-4)


# ---------------------------------------------------------------- tests


def test_data_parallel_matches_whole_batch_single_process(runs):
    assert_matches_single_process(runs["dp"])


def test_data_parallel_sketch_is_the_whole_batch_sketch(runs):
    """After all_reduce_sketches: C = G P, G the float64 gradient of the whole-batch loss."""
    record = runs["dp"][0]
    pre = {k: v.double() for k, v in record["pre"][0].items()}
    x, y = batch(0)
    w_up = pre["up_proj.weight"].clone().requires_grad_(True)
    out = (torch.tanh(x.double() @ w_up.t()) @ pre["down_proj.weight"].t() @ pre["head.weight"].t()
           + pre["head.bias"])
    (grad,) = torch.autograd.grad((out - y.double()).square().mean(), w_up)
    expected = grad @ record["projection"].double()
    # The forward ran in BF16, hence the loose tolerance; one rank's half-batch sketch is off
    # by O(1) of the norm.
    err = (record["sketch"].double() - expected).norm() / expected.norm()
    assert err < 3e-2, float(err)


@pytest.mark.parametrize("name", ["fsdp", "fsdp_reshard"])
def test_fsdp2_matches_whole_batch_single_process(runs, name):
    """With and without reshard_after_forward (which frees the gathered weight that backward
    then needs, and gathers it again before backward)."""
    assert_matches_single_process(runs[name])


@pytest.mark.parametrize("name", ["dp", "fsdp", "fsdp_reshard"])
def test_step_reads_no_device_value_on_the_host(runs, name):
    """No .item()/float()/bool() of a device value in step() on 2 ranks (collectives only)."""
    for record in runs[name]:
        assert record["syncs"] == [{}] * STEPS, record["syncs"]


def test_fsdp2_never_holds_a_dense_gradient_or_update(runs):
    """Backward and step. With reshard_after_forward=False FSDP gathers no compressed weight in
    backward, so any tensor of d x k elements would be a gradient or an update."""
    smallest_dense = min(37 * 24, 16 * 37)
    for record in runs["fsdp"]:
        assert record["largest"] < smallest_dense, record["largest"]


def test_bytes_per_step(runs):
    sketch_bytes = (37 + 16) * RANK * 4
    head_bytes = (16 * 5 + 5) * 4
    for record in runs["dp"]:
        for calls in record["bytes"]:
            # one FP32 bucket, not one collective per tensor: a presence flag per tensor, the
            # two sketches and the two head gradients
            assert calls == [("all_reduce", 4 * 4 + sketch_bytes + head_bytes)]
    dense = runs["dp"][0]["ddp_bytes"]
    assert dense == (37 * 24 + 16 * 37) * 2
    ratio = dense / sketch_bytes
    assert ratio == pytest.approx((37 * 24 + 16 * 37) * 2 / ((37 + 16) * RANK * 4))

    padded = (2 * math.ceil(37 / 2) + 16) * RANK * 4
    for record in runs["fsdp"]:
        for calls in record["bytes"]:
            names = [name for name, _ in calls]
            assert names[0].startswith("reduce_scatter") and names[1:] == ["all_reduce"]
            # sketches (37 rows padded to 38) + one flag per layer per rank; then 3 FP32
            # scalars per parameter (||W||^2, ||H||^2, non-finite count)
            assert calls[0][1] == padded + WORLD * 2 * 4
            assert calls[1][1] == 4 * 3 * 4


def _dcp_worker(rank: int, out: Path, phase: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard

    net = build(init_seed=0 if phase == "save" else 1)
    fully_shard(net.head)
    fully_shard(net)
    opt = DistributedRGCOptimizer(net.parameters(), lr=LR, seed=5)
    if phase == "save":
        for step in range(2):
            loss_on(net, step, rank, WORLD).backward()
            opt.step()
            opt.zero_grad()
        model_sd, optim_sd = get_state_dict(net, opt)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(out.parent / "ckpt"))
    else:
        model_sd, optim_sd = get_state_dict(net, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=str(out.parent / "ckpt"))
        set_state_dict(net, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    for step in range(2, 4):
        loss_on(net, step, rank, WORLD).backward()
        opt.step()
        opt.zero_grad()
    torch.save(full_state(net), out / f"final{rank}.pt")


def test_dcp_save_restart_resume_is_bit_identical(tmp_path):
    spawn(_dcp_worker, tmp_path / "save", "save")
    spawn(_dcp_worker, tmp_path / "resume", "resume")
    for r in range(WORLD):
        straight = torch.load(tmp_path / "save" / f"final{r}.pt")
        resumed = torch.load(tmp_path / "resume" / f"final{r}.pt")
        assert straight.keys() == resumed.keys()
        for k in straight:
            assert torch.equal(straight[k], resumed[k]), k


def _mismatch_worker(rank: int, out: Path) -> None:
    messages = []
    net = build(wrap_seed=3 + rank)
    try:
        DistributedRGCOptimizer(net.parameters(), lr=LR)
    except RuntimeError as e:
        messages.append(str(e))
    net = build()
    try:
        DistributedRGCOptimizer(net.parameters(), lr=LR, seed=rank)
    except RuntimeError as e:
        messages.append(str(e))
    try:
        all_reduce_sketches(build(wrap_seed=rank))
    except RuntimeError as e:
        messages.append(str(e))
    check_seeds(build())  # consistent: no error

    net = build()
    opt = DistributedRGCOptimizer(net.parameters(), lr=LR)
    ddp = nn.parallel.DistributedDataParallel(net)
    try:
        all_reduce_sketches(ddp)
    except TypeError as e:
        messages.append(str(e))
    x, y = batch(0)
    (ddp(x) - y).square().mean().backward()
    before = full_state(net)
    try:
        opt.step()
    except RuntimeError as e:
        messages.append(str(e))
    assert all(torch.equal(v, before[k]) for k, v in full_state(net).items())
    (out / f"messages{rank}.txt").write_text("\n---\n".join(messages))


def test_seed_mismatch_and_ddp_are_caught_at_start_up(tmp_path):
    spawn(_mismatch_worker, tmp_path)
    for r in range(WORLD):
        messages = (tmp_path / f"messages{r}.txt").read_text().split("\n---\n")
        assert len(messages) == 5, messages
        assert all("DistributedDataParallel" in m for m in messages[3:])
        assert "projection seeds" in messages[0] and "rounding seeds" not in messages[0]
        assert "rounding seeds" in messages[1] and "projection seeds" not in messages[1]
        assert "projection seeds" in messages[2]
        assert "rgc.wrap(model, rank, seed=...)" in messages[0]


# ---------------------------------------------------------------- single process


def test_without_process_group_it_is_rgc_optimizer():
    a, b = build(), build()
    opt_a = rgc.RGCOptimizer(a.parameters(), lr=LR, seed=5)
    opt_b = DistributedRGCOptimizer(b.parameters(), lr=LR, seed=5)
    for step in range(2):
        for net, opt in ((a, opt_a), (b, opt_b)):
            loss_on(net, step).backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values(), strict=True))
    assert all_reduce_sketches(a) == 0


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_mb"):
        DistributedRGCOptimizer(build().parameters(), lr=LR, bucket_mb=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        all_reduce_sketches(build(), bucket_mb=-1)
    with pytest.raises(TypeError, match="nn.Module or an optimizer"):
        all_reduce_sketches(object())



@settings(max_examples=10)
@given(d=st.integers(1, 40), k=st.integers(1, 24), r=st.integers(1, 6),
       world=st.integers(2, 5), seed=st.integers(0, 2**40))
def test_row_shards_updated_with_their_offset_equal_the_unsharded_update(d, k, r, world, seed):
    """What FSDP2 ranks do (torch.chunk row shards, offset first_row * k) is bit-identical."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(d, k, generator=gen).bfloat16()
    sketch = torch.randn(d, r, generator=gen)
    projection = torch.randn(k, r, generator=gen)
    whole, pieces = weight.clone(), weight.clone()
    apply_lowrank_update_(whole, sketch, projection, 0.3, seed=seed)
    chunk = -(-d // world)
    for start in range(0, d, chunk):
        rows = slice(start, start + chunk)
        apply_lowrank_update_(pieces[rows], sketch[rows], projection, 0.3, seed=seed,
                              offset=start * k)
    assert torch.equal(whole, pieces)
    assert not torch.equal(whole, weight)


def test_example_runs_under_torchrun(tmp_path):
    """examples/distributed.py with FSDP2 and a DCP checkpoint, as documented (2 steps)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         str(root / "examples" / "distributed.py"), "--fsdp", "--steps", "2",
         "--checkpoint", str(tmp_path / "ckpt")],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "weights agree across ranks: True" in result.stdout
    assert (tmp_path / "ckpt" / ".metadata").exists()
