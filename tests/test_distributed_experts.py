"""Stacks of experts sharded by FSDP2 (``fully_shard``'s default ``Shard(0)``: whole experts
per rank), on 2 and 4 CPU processes (gloo), against one process stepping the whole batch.

Two runs (one per world size) cover a tiny Qwen3-MoE (5 experts: an uneven split, and on 4
processes a rank that holds none) and a tiny Mixtral (4 experts), each sharded per decoder
layer and as a whole, with RGCOptimizer (``expert_norm`` ``'expert'`` and ``'stack'``) and
RowAdam (with and without annealed PredictedKL), ``keep_updates=True`` and a payload per
step; the Qwen3-MoE also built on the meta device, and (2 processes) saved with
``torch.distributed.checkpoint`` and resumed by a third run. The assertions run here.

On 2 processes every sum is formed in the single process's order: the two sketches are
added as the micro-batches are accumulated (``a + b`` either way), and an expert's partial
sums are complete on the rank that holds it (the stack's totals are gathered, not re-summed),
so the weights are bit-identical. On 4 processes gloo adds the four sketches in an order of
its own: a BF16 weight can only differ where stochastic rounding falls the other way, by one
ulp, in a small fraction of elements (as in ``tests/test_distributed.py``).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import _disable_current_modes

import rgc
from rgc.distributed import DistributedRGCOptimizer, DistributedRowAdam
from tests.test_distributed import bf16_ulps, dcp_save_or_load, full_state, load, spawn

pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.slow]

STEPS = 3
RANK = 4
LR = {"rgc": 1e-2, "rgc-stack": 1e-2, "rowadam": 2e-3, "rowadam-kl": 2e-3}
FAMILIES = {"qwen3_moe": 5, "mixtral": 4}  # experts per layer
# rowadam-kl: the LoGRA recipe, RowAdam with annealed PredictedKL (each rank probes its share)
RULES = ("rgc", "rgc-stack", "rowadam", "rowadam-kl")
BUDGET = (2e-5, 2e-6)  # small enough that alpha < 1 on most steps


def _model(family: str, init_seed: int = 0):
    from tests.models import tiny_moe

    model = tiny_moe(family, dtype=torch.bfloat16, seed=init_seed, layers=2,
                     experts=FAMILIES[family])
    return rgc.wrap(model, rank=RANK, seed=3)


def _shard(model):
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    return model


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(step))


def _loss(model, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    ids = _ids(step)[rank * 4 // world:(rank + 1) * 4 // world]
    return model(input_ids=ids, labels=ids).loss


class _ProbeUntracked(rgc.PredictedKL):
    """PredictedKL whose probe forwards (in ``scale`` and ``after_update``) are left out of
    an open :func:`rgc.memory.track`: FSDP2 gathers each layer's weights for them as for any
    forward, which is the model's memory, not the step's."""

    def scale(self, optimizer, updates):
        with _disable_current_modes():
            return super().scale(optimizer, updates)

    def after_update(self):
        with _disable_current_modes():
            return super().after_update()


def _optimizer(rule: str, params, *, distributed: bool, **kwargs):
    if rule.startswith("rowadam"):
        cls = DistributedRowAdam if distributed else rgc.RowAdam
        control = (_ProbeUntracked(BUDGET[0], BUDGET[1], anneal_steps=STEPS - 1)
                   if rule == "rowadam-kl" else None)
        return cls(params, lr=LR[rule], seed=5, step_control=control, **kwargs)
    cls = DistributedRGCOptimizer if distributed else rgc.RGCOptimizer
    return cls(params, lr=LR[rule], seed=5,
               expert_norm="stack" if rule == "rgc-stack" else "expert", **kwargs)


def _probe(model, opt, step: int, rank: int = 0, world: int = 1) -> None:
    """With a step controller: this rank's share of the step's batch is its probe."""
    if opt.step_control is not None:
        ids = _ids(step)[rank * 4 // world:(rank + 1) * 4 // world]
        opt.step_control.set_probe(model, {"input_ids": ids})


def _steps(model, opt, rank: int, world: int, steps: range, record: dict) -> None:
    """Train ``steps``; records each step's weights before and after, its payload, the
    largest tensor the step allocated, the bytes rgc passed to collectives and the step
    controller's records."""
    for key in ("pre", "post", "payloads", "comm"):
        record.setdefault(key, [])
    record.setdefault("largest", 0)
    state = full_state(model)  # a collective: a step's weights after are the next's before
    for step in steps:
        record["pre"].append(state)
        _loss(model, step, rank, world).backward()
        _probe(model, opt, step, rank, world)
        with rgc.memory.track() as tracked:
            opt.step()
        sizes = [math.prod(a.shape) for a in tracked.allocations]
        record["largest"] = max([record["largest"], *sizes])
        record["comm"].append(opt.last_comm_bytes)
        opt.zero_grad()
        record["payloads"].append(opt.export_update(model))  # collective
        state = full_state(model)
        record["post"].append(state)
    if opt.step_control is not None:
        record["history"] = list(opt.step_control.history)


def _train(rank: int, world: int, family: str, rule: str, *, meta: bool = False) -> dict:
    if meta:  # meta init -> wrap -> fully_shard -> to_empty -> init -> load the checkpoint
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        weights = full_state(_model(family))
        with torch.device("meta"):
            model = _model(family)
        _shard(model).to_empty(device="cpu")
        model.init_weights()  # transformers' init: the rotary buffers no checkpoint holds
        set_model_state_dict(model, weights, options=StateDictOptions(full_state_dict=True))
    else:
        model = _shard(_model(family))
    stacks = [p for p in model.parameters() if p.dim() == 3]
    assert stacks and all(isinstance(p, torch.distributed.tensor.DTensor) for p in stacks)
    # one bucket per sketch: the largest tensor of the step is then one layer's (a bucket
    # of all of a tiny model's sketches outgrows one of its stacks)
    opt = _optimizer(rule, model.parameters(), distributed=True, keep_updates=True,
                     bucket_mb=1e-4)
    record = {}
    _steps(model, opt, rank, world, range(STEPS), record)
    return record


def _dcp(rank: int, world: int, out: Path, phase: str) -> dict:
    """RowAdam and RGCOptimizer on the sharded Qwen3-MoE: 2 steps, a checkpoint, 2 more; or a
    differently initialised model loading the checkpoint and stepping 2."""
    finals = {}
    for rule in ("rowadam", "rgc-stack"):
        model = _shard(_model("qwen3_moe", init_seed=0 if phase == "save" else 1))
        opt = _optimizer(rule, model.parameters(), distributed=True, keep_updates=True)
        if phase == "save":
            _steps(model, opt, rank, world, range(2), {})
        dcp_save_or_load(model, opt, str(out.parent / f"ckpt-{rule}"), phase)
        finals[rule] = {}
        _steps(model, opt, rank, world, range(2, 4), finals[rule])
    return finals


def _worker(rank: int, world: int, out: Path) -> None:
    records = {(family, rule): _train(rank, world, family, rule)
               for family in FAMILIES for rule in RULES}
    records["meta"] = _train(rank, world, "qwen3_moe", "rowadam", meta=True)
    if world == 2:
        records["dcp"] = _dcp(rank, world, out, "save")
    torch.save(records, out / f"experts{rank}.pt")


def _resume_worker(rank: int, world: int, out: Path) -> None:
    torch.save(_dcp(rank, world, out, "resume"), out / f"experts{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("distributed_experts")
    results = {}
    for world in (2, 4):
        spawn(_worker, out / f"world{world}", world)
        results[world] = [torch.load(out / f"world{world}" / f"experts{r}.pt",
                                     weights_only=False) for r in range(world)]
    spawn(_resume_worker, out / "resume", 2)
    results["resumed"] = [torch.load(out / "resume" / f"experts{r}.pt", weights_only=False)
                          for r in range(2)]
    return results


def _single_process(family: str, rule: str, world: int, pres: list[dict]
                    ) -> tuple[list[dict], list[dict]]:
    """One process from each step's weights, the ranks' shares as micro-batches (and the
    whole batch as the probe); the weights after each step and the controller's records."""
    model = _model(family)
    opt = _optimizer(rule, model.parameters(), distributed=False)
    posts = []
    for step, pre in enumerate(pres):
        load(model, pre)
        for r in range(world):
            (_loss(model, step, r, world) / world).backward()
        _probe(model, opt, step)
        opt.step()
        opt.zero_grad()
        posts.append(full_state(model))
    return posts, list(opt.step_control.history) if opt.step_control is not None else []


def _assert_matches(got: dict, ref: dict, *, exact: bool, where) -> int:
    """Equal bits, or (``exact`` false) BF16 weights within one ulp in at most 1% of elements;
    returns the elements that differ."""
    differing = 0
    for k, v in ref.items():
        if exact:
            assert torch.equal(got[k], v), (where, k)
            continue
        ulps = bf16_ulps(got[k], v)
        assert int(ulps.max()) <= 1, (where, k, int(ulps.max()))
        assert int((ulps > 0).sum()) <= max(1, ulps.numel() // 100), (where, k)
        differing += int((ulps > 0).sum())
    return differing


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_sharded_expert_stacks_equal_one_process_on_the_whole_batch(runs, world, family, rule):
    """Every rank ends every step with the single process's weights (bit for bit on 2
    processes without step control), the expert stacks move, and a receiver of the payloads
    follows bit for bit. With PredictedKL, whose kappa sums the ranks' probe tokens in another
    order, within one ulp; kappa and alpha agree and the controller scales the steps."""
    records = [r[(family, rule)] for r in runs[world]]
    reference, history = _single_process(family, rule, world, records[0]["pre"])
    receiver = _model(family)
    load(receiver, records[0]["pre"][0])
    stacks = [n for n, p in receiver.named_parameters() if p.dim() == 3]
    assert len(stacks) == 4  # gate_up_proj and down_proj of 2 layers
    for step, ref in enumerate(reference):
        got = records[0]["post"][step]
        for other in records[1:]:
            assert all(torch.equal(v, got[k]) for k, v in other["post"][step].items())
        _assert_matches(got, ref, exact=world == 2 and not history,
                        where=(family, rule, world, step))
        pre = records[0]["pre"][step]
        assert all(not torch.equal(got[n], pre[n]) for n in stacks), step
        rgc.apply_update(receiver, records[0]["payloads"][step])
        assert all(torch.equal(v, got[k]) for k, v in full_state(receiver).items()), step
    for mine, theirs in zip(records[0].get("history", []), history, strict=True):
        assert mine["kappa"] == pytest.approx(theirs["kappa"], rel=1e-5)
        assert mine["alpha"] == pytest.approx(theirs["alpha"], rel=1e-5)
    if history:
        assert min(h["alpha"] for h in history) < 1.0, "the controller never scaled a step"


@pytest.mark.parametrize("world", [2, 4])
def test_the_step_never_gathers_an_expert_stack(runs, world):
    """What crosses the network per step is the E x d x r sketches and a few sums, far below
    the stacks' BF16 bytes, and no tensor the step allocates holds a whole stack (FSDP2's own
    all-gather of a layer's weights for forward is FSDP's, not the step's)."""
    for family in FAMILIES:
        model = _model(family)
        stacks = [p for p in model.parameters() if p.dim() == 3]
        sketch_bytes = sum(4 * RANK * p.numel() // p.shape[2] for p in stacks)
        for rule in RULES:
            for records in runs[world]:
                record = records[(family, rule)]
                assert 0 < record["largest"] < min(p.numel() for p in stacks), (family, rule)
                for sent in record["comm"]:
                    # the reduce-scatter carries every sketch once (padded), then the sums
                    assert sketch_bytes <= sent < sum(2 * p.numel() for p in stacks), \
                        (family, rule, sent)


def test_meta_initialised_sharded_experts_equal_a_materialised_run(runs):
    for world in (2, 4):
        for records in runs[world]:
            want = records[("qwen3_moe", "rowadam")]["post"]
            for step, (got, ref) in enumerate(zip(records["meta"]["post"], want, strict=True)):
                assert got.keys() == ref.keys()
                assert all(torch.equal(got[k], v) for k, v in ref.items()), (world, step)


def test_dcp_resume_of_sharded_experts_is_bit_identical(runs):
    """From fresh processes and a differently initialised model: weights and payloads
    continue as if uninterrupted (RowAdam's moments and per-expert counts resharded by DCP)."""
    for straight, resumed in zip((r["dcp"] for r in runs[2]), runs["resumed"], strict=True):
        for rule in ("rowadam", "rgc-stack"):
            a, b = straight[rule], resumed[rule]
            for sa, sb in zip(a["post"], b["post"], strict=True):
                assert all(torch.equal(sa[k], sb[k]) for k in sa), rule
            for pa, pb in zip(a["payloads"], b["payloads"], strict=True):
                assert pa.keys() == pb.keys()
                assert all(torch.equal(pa[k], pb[k]) for k in pa), rule


@pytest.mark.parametrize("dense", [False, True], ids=["moe", "dense"])
def test_large_model_example_runs_under_torchrun(tmp_path, dense):
    """examples/large_model.py as documented (2 steps): meta init, FSDP2, payloads, and the
    replica bit-identical at the end. A run that printed everything and then aborted in gloo's
    teardown is run once more, as for examples/distributed.py."""
    import os
    import subprocess
    import sys

    from tests.test_distributed import TEARDOWN_ABORT, TIMEOUT_S

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    for _ in range(2):
        result = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
             "2", str(root / "examples" / "large_model.py"), "--steps", "2",
             *(["--dense"] if dense else [])],
            capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=tmp_path)
        finished = "replica bit-identical to the trained policy: True" in result.stdout
        if result.returncode == 0 or not finished or TEARDOWN_ABORT not in result.stderr:
            break
    assert result.returncode == 0, result.stdout + result.stderr
    assert finished and "step  1" in result.stdout, result.stdout
