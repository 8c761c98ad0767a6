"""Data parallel and FSDP2 training on 2 and 4 CPU processes (gloo), for every rule.

Three multi-process runs cover everything (starting processes costs more than the steps): on
2 and on 4 processes the matrix {RGCOptimizer, RowAdam} x {data parallel, FSDP2} x {fixed step,
annealed PredictedKL}, 10 steps each with ``keep_updates=True``; on 2 processes also FSDP2 with
resharding after forward, tiny buckets, expert stacks under data parallel, the refusals, and a
distributed checkpoint that a third run resumes. The workers write what they saw to files; the
assertions run here, against a single process stepping the whole batch and against float64
formulas.

The single-process reference backpropagates the ranks' shares of each batch as micro-batches
(each loss divided by the world size, an exact power of two), so its sketch is ``sum_i C_i / N``
summed in rank order, and its probe is the ranks' probes together. Where every FP32 sum is
formed in the same order as on the ranks, the weights are bit-identical; where not, a BF16
weight can only differ where stochastic rounding falls the other way (see ``EXACT``).
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
from rgc.distributed import (
    DistributedRGCOptimizer,
    DistributedRowAdam,
    all_reduce_sketches,
    check_seeds,
)
from rgc.updates import apply_lowrank_update_
from tests.test_step_sync import CountSyncs

# slow as a whole: its runs fixture starts eight processes (~30 s) before any test
pytestmark = [pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable"),
              pytest.mark.slow]

RANK = 4
STEPS = 10
BATCH = 8  # a share for each of 2 and 4 processes
TIMEOUT_S = 600  # a hang guard; the longest run takes about a minute on 2 idle cores
LR = {"rgc": 1e-2, "rowadam": 2e-3, "rgc-momentum": 1e-2}
BUDGET = (2e-5, 2e-6)  # PredictedKL's annealed budget: alpha < 1 on most steps
COMPRESSED = ("up_proj.weight", "down_proj.weight", "o_proj.weight")
SHAPES = {"up_proj.weight": (37, 24), "down_proj.weight": (16, 37), "o_proj.weight": (3, 16)}
SCENARIOS = [(rule, mode, kl) for rule in ("rgc", "rowadam") for mode in ("dp", "fsdp")
             for kl in (False, True)]
# RGCOptimizer with Nesterov momentum (its buffer carried into the new P after every step)
# and rows of equal norm
SCENARIOS += [("rgc-momentum", mode, False) for mode in ("dp", "fsdp")]


class Net(nn.Module):
    """Three BF16 compressed layers (37 rows: FSDP pads the last shard; 3 rows: an empty shard
    on 4 processes) and an FP32 head."""

    def __init__(self):
        super().__init__()
        self.up_proj = nn.Linear(24, 37, bias=False)
        self.down_proj = nn.Linear(37, 16, bias=False)
        self.o_proj = nn.Linear(16, 3, bias=False)
        self.head = nn.Linear(19, 5)

    def forward(self, x):
        h = self.down_proj(torch.tanh(self.up_proj(x)))
        return self.head(torch.cat([h, self.o_proj(h)], dim=-1).float())


def build(init_seed: int = 0, wrap_seed: int = 3, head: bool = True) -> Net:
    torch.manual_seed(init_seed)
    net = Net()
    for name in ("up_proj", "down_proj", "o_proj"):
        getattr(net, name).bfloat16()
    net = rgc.wrap(net, RANK, targets=["up_proj", "down_proj", "o_proj"], seed=wrap_seed,
                   freeze_others=False)
    net.head.requires_grad_(head)
    return net


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return (torch.randn(BATCH, 24, generator=gen).bfloat16(),
            torch.randn(BATCH, 5, generator=gen))


def share(rank: int, world: int) -> slice:
    return slice(rank * BATCH // world, (rank + 1) * BATCH // world)


def probe(rank: int = 0, world: int = 1) -> torch.Tensor:
    """The probe batch of PredictedKL: each rank its share, one process all of it."""
    return torch.randn(BATCH, 24, generator=torch.Generator().manual_seed(7)).bfloat16()[
        share(rank, world)]


def loss_on(net, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    x, y = batch(step)
    return (net(x[share(rank, world)]) - y[share(rank, world)]).square().mean()


def full_state(net) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in net.state_dict().items()}


def make_optimizer(rule: str, params, *, distributed: bool, kl: bool, **kwargs):
    """The optimizer of a scenario and its controller (``None`` without PredictedKL)."""
    ctl = rgc.PredictedKL(BUDGET[0], BUDGET[1], anneal_steps=STEPS // 2) if kl else None
    cls = {("rgc", False): rgc.RGCOptimizer, ("rgc", True): DistributedRGCOptimizer,
           ("rowadam", False): rgc.RowAdam, ("rowadam", True): DistributedRowAdam}
    extra = {"weight_decay": 0.01} if rule == "rowadam" else {}
    if rule == "rgc-momentum":
        rule, extra = "rgc", {"momentum": 0.9, "nesterov": True, "row_norm": True}
    return cls[rule, distributed](params, lr=LR[rule], seed=5, step_control=ctl,
                                  **extra, **kwargs), ctl


# ---------------------------------------------------------------- process plumbing


def _entry(fn, rank, world, out_dir, args):
    torch.set_num_threads(1)
    # Eager CPU rounding and Gaussians (the same bits as the compiled loop, which every fresh
    # process would otherwise spend ~15 s compiling): the reference, compiled, runs here
    torch._dynamo.config.disable = True
    try:
        dist.init_process_group("gloo", init_method=f"file://{out_dir}/store", rank=rank,
                                world_size=world)
        fn(rank, world, Path(out_dir), *args)
        dist.barrier()  # no rank tears gloo down while a peer's last collective is in flight
        dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


#: What the workers import, imported once by the server they are forked from (``spawn``
#: imported it in each of the eight processes: about 1,000 modules and 4 s of CPU apiece).
PRELOAD = [__name__, "tests.models", "torch.distributed.fsdp",
           "torch.distributed.checkpoint.state_dict", "functorch.compile",
           "transformers.models.qwen3_moe.modeling_qwen3_moe"]


def _start_method():
    """A forkserver where the platform has one (a name that fails to import is skipped)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect at the server's first start
    return ctx


def spawn(fn, out_dir: Path, world: int, *args) -> None:
    """Run ``fn(rank, world, out_dir, *args)`` on ``world`` new processes joined by gloo."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "store").unlink(missing_ok=True)
    ctx = _start_method()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, str(out_dir), args))
             for r in range(world)]
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


def _called_from_rgc() -> bool:
    frame = traceback.extract_stack(limit=3)[0]
    return "/rgc/" in frame.filename


class CountCollectives:
    """Bytes of the tensors rgc passes to all_reduce / reduce_scatter / all_gather (FSDP's own
    collectives, and the tests', are not counted)."""

    NAMES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor",
             "all_gather_single", "all_gather_into_tensor")

    def __init__(self):
        self.calls: list[tuple[str, int]] = []
        self._saved = {}

    def __enter__(self):
        for name in self.NAMES:
            original = getattr(dist, name, None)
            if original is None:
                continue
            self._saved[name] = original

            def counted(*args, _name=name, _original=original, **kwargs):
                if _called_from_rgc():
                    tensor = args[0] if _name == "all_reduce" else args[1]
                    self.calls.append((_name.split("_")[0] + "_" + _name.split("_")[1],
                                       tensor.numel() * tensor.element_size()))
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)


class CountHostCopies:
    """``Tensor.tolist()`` calls made by rgc (a host copy that :class:`CountSyncs`, which sees
    ``.item()``/``float()``/``bool()``, does not)."""

    def __init__(self):
        self.count = 0

    def __enter__(self):
        self._original = original = torch.Tensor.tolist

        def counted(tensor):
            if _called_from_rgc():
                self.count += 1
            return original(tensor)

        torch.Tensor.tolist = counted
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._original


# ---------------------------------------------------------------- workers


def _shard(net: Net, reshard: bool = False) -> Net:
    from torch.distributed.fsdp import fully_shard

    fully_shard(net.head, reshard_after_forward=True)
    fully_shard(net, reshard_after_forward=reshard)
    return net


def _train(rank: int, world: int, scenario, *, reshard: bool = False,
           bucket_mb: float = 25.0) -> dict:
    """STEPS steps of a scenario with keep_updates; what a test needs of each step."""
    rule, mode, kl = scenario
    # FSDP2 with step control needs every trainable sharded parameter sketched: the head is
    # frozen there (and trainable everywhere else: the dense path is covered)
    net = build(head=not (kl and mode == "fsdp"))
    if mode == "fsdp":
        _shard(net, reshard)
    opt, ctl = make_optimizer(rule, net.parameters(), distributed=True, kl=kl,
                              keep_updates=True, bucket_mb=bucket_mb)
    if ctl is not None:
        ctl.set_probe(net, probe(rank, world))
    record = {"pre": [], "post": [], "calls": [], "comm": [], "syncs": [], "copies": [],
              "payloads": [], "export_bytes": []}
    state = full_state(net)  # a collective: a step's weights after are the next's before
    for step in range(STEPS):
        record["pre"].append(state)
        loss_on(net, step, rank, world).backward()
        with CountCollectives() as count, CountSyncs() as syncs, CountHostCopies() as copies:
            opt.step()
        opt.zero_grad()
        record["calls"].append(count.calls)
        record["comm"].append(opt.last_comm_bytes)
        record["syncs"].append(sum(syncs.syncs.values()))
        record["copies"].append(copies.count)
        payload = opt.export_update(net)  # collective under FSDP2: every rank calls it
        record["export_bytes"].append(opt.last_export_bytes)
        if rank == 0:
            record["payloads"].append(payload)
        state = full_state(net)
        record["post"].append(state)
    record["history"] = ctl.history if ctl is not None else None
    if rule == "rowadam":  # every rank calls full_tensor() in the same order: collective
        record["moments"] = {name: row_moments(opt.state[p]) for name, p in
                             net.named_parameters() if name in COMPRESSED}
    return record


def row_moments(state) -> dict[str, tuple[tuple[int, ...], torch.Tensor]]:
    """RowAdam's ``exp_avg`` and ``exp_avg_sq`` of a weight: the shape this process holds, and
    the whole tensor."""
    return {key: (tuple(v.to_local().shape), v.full_tensor()) if hasattr(v, "full_tensor")
            else (tuple(v.shape), v.clone()) for key, v in state.items()
            if key in ("exp_avg", "exp_avg_sq")}


def _matrix_worker(rank: int, world: int, out: Path) -> None:
    records = {scenario: _train(rank, world, scenario) for scenario in SCENARIOS}
    records["meta"] = {rule: _train_meta(rank, world, rule) for rule in ("rgc", "rowadam")}
    if world == 2:
        records["reshard"] = _train(rank, world, ("rowadam", "fsdp", True), reshard=True)
        records["tiny_buckets"] = _train(rank, world, ("rgc", "dp", True), bucket_mb=1e-4)
        records["experts"] = {rule: _train_experts(rank, world, rule)
                              for rule in ("rgc", "rowadam", "rowadam-fsdp")}
        records["refusals"] = _refusals(rank, world)
        records["largest"] = _largest_tensor(rank, world)
        records["sketch"] = _whole_batch_sketch(rank, world)
        records["clip"] = {mode: _train_clipped(rank, world, mode) for mode in ("dp", "fsdp")}
        _dcp_save(rank, world, out)
    torch.save(records, out / f"matrix{rank}.pt")


def _train_meta(rank: int, world: int, rule: str) -> list[dict]:
    """The large-model set-up: the model built and wrapped on the meta device, sharded, then
    materialised with ``to_empty`` and loaded from a full state dict
    (``set_model_state_dict``); STEPS steps of the fixed-step FSDP2 scenario. The states after
    each step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    weights = full_state(build())  # what the checkpoint holds
    with torch.device("meta"):
        net = build()
    _shard(net)
    net.to_empty(device="cpu")
    set_model_state_dict(net, weights, options=StateDictOptions(full_state_dict=True))
    opt, _ = make_optimizer(rule, net.parameters(), distributed=True, kl=False)
    posts = []
    for step in range(STEPS):
        loss_on(net, step, rank, world).backward()
        opt.step()
        opt.zero_grad()
        posts.append(full_state(net))
    return posts


CLIP_STEPS = 3
MAX_NORM = 1e-2  # far below the gradients' norm: every step is clipped


def _train_clipped(rank: int, world: int, mode: str) -> dict:
    """RowAdam with rgc.integrations.clip_grad_norm_ before each step (deferred to the step,
    by the global norm); the norms it returned, read after each step, and the weights."""
    from rgc.integrations import clip_grad_norm_

    net = build()
    if mode == "fsdp":
        _shard(net)
    opt, _ = make_optimizer("rowadam", net.parameters(), distributed=True, kl=False)
    record = {"pre": [], "post": [], "norms": []}
    for step in range(CLIP_STEPS):
        record["pre"].append(full_state(net))
        loss_on(net, step, rank, world).backward()
        norm = clip_grad_norm_(opt, MAX_NORM)
        opt.step()
        opt.zero_grad()
        record["norms"].append(norm.clone())
        record["post"].append(full_state(net))
    record["moments"] = {name: row_moments(opt.state[p]) for name, p in net.named_parameters()
                         if name in COMPRESSED}
    return record


def _experts_model(init_seed: int = 0):
    from tests.models import tiny_moe

    model = tiny_moe("qwen3_moe", dtype=torch.bfloat16, seed=init_seed, layers=1)
    return rgc.wrap(model, rank=RANK, seed=3)


def _expert_ids(step: int) -> torch.Tensor:
    return torch.randint(0, 64, (4, 6), generator=torch.Generator().manual_seed(step))


def _expert_loss(model, step: int, rank: int = 0, world: int = 1) -> torch.Tensor:
    ids = _expert_ids(step)[rank * 4 // world:(rank + 1) * 4 // world]
    return model(input_ids=ids, labels=ids).loss


def _train_experts(rank: int, world: int, rule: str) -> dict:
    """Data parallel over a mixture-of-experts model: its [E, d, k] stacks are all-reduced.
    ``rowadam-fsdp``: FSDP2 shards the attention projections by rows and keeps the expert
    stacks whole (``ignored_params``): the same optimizer reduce-scatters the former and
    all-reduces the latter."""
    model = _experts_model()
    if rule.endswith("-fsdp"):
        from torch.distributed.fsdp import fully_shard

        fully_shard(model, ignored_params={p for p in model.parameters() if p.dim() == 3})
    cls = DistributedRGCOptimizer if rule == "rgc" else DistributedRowAdam
    opt = cls(model.parameters(), lr=LR[rule.removesuffix("-fsdp")], seed=5, keep_updates=True)
    record = {"pre": [], "post": [], "payloads": []}
    for step in range(STEPS):
        record["pre"].append(full_state(model))
        _expert_loss(model, step, rank, world).backward()
        opt.step()
        opt.zero_grad()
        record["payloads"].append(opt.export_update(model))
        record["post"].append(full_state(model))
    return record


def _refusals(rank: int, world: int) -> list[str]:
    """The errors of mismatched seeds, of DDP, of step control beside an unsketched sharded
    parameter, and of a single-process optimizer given sharded parameters."""
    messages = []

    def caught(fn, kind=RuntimeError):
        try:
            fn()
        except kind as e:
            messages.append(str(e))

    models = [build(wrap_seed=3 + rank), build(), build(wrap_seed=rank), build()]  # kept alive
    caught(lambda: DistributedRGCOptimizer(models[0].parameters(), lr=0.1))
    caught(lambda: DistributedRowAdam(models[1].parameters(), lr=0.1, seed=rank))
    caught(lambda: all_reduce_sketches(models[2]))
    check_seeds(models[3])  # consistent: no error

    net = build()
    opt = DistributedRGCOptimizer(net.parameters(), lr=0.1)
    ddp = nn.parallel.DistributedDataParallel(net)
    caught(lambda: all_reduce_sketches(ddp), TypeError)
    x, y = batch(0)
    (ddp(x) - y).square().mean().backward()
    before = full_state(net)
    caught(opt.step)
    assert all(torch.equal(v, before[k]) for k, v in full_state(net).items())

    sharded = _shard(build())
    caught(lambda: DistributedRowAdam(sharded.parameters(), step_control=rgc.PredictedKL()),
           NotImplementedError)
    caught(lambda: rgc.RGCOptimizer(sharded.parameters(), lr=0.1), ValueError)
    return messages


def dcp_save_or_load(model, opt, checkpoint: str, phase: str, extra: dict | None = None
                     ) -> dict:
    """With torch.distributed.checkpoint: save (``phase == 'save'``) or load the model, the
    optimizer and ``extra`` (a dict of state dicts, its loaded values returned) at
    ``checkpoint``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd, "extra": extra or {}}
    if phase == "save":
        dcp.save(state, checkpoint_id=checkpoint)
    else:
        dcp.load(state, checkpoint_id=checkpoint)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return state["extra"]


def _dcp_run(rank: int, world: int, out: Path, phase: str) -> dict:
    """The LoGRA recipe (RowAdam + annealed PredictedKL, FSDP2) and RGCOptimizer under FSDP2:
    2 steps, a checkpoint, 2 more; or a fresh model loading the checkpoint and stepping 2."""
    finals = {}
    for rule, kl in (("rowadam", True), ("rgc", False)):
        net = _shard(build(init_seed=0 if phase == "save" else 1, head=not kl))
        opt, ctl = make_optimizer(rule, net.parameters(), distributed=True, kl=kl,
                                  keep_updates=True)
        if ctl is not None:
            ctl.set_probe(net, probe(rank, world))  # before get_state_dict: see docs
        checkpoint = str(out.parent / f"ckpt-{rule}")
        if phase == "save":
            for step in range(2):
                loss_on(net, step, rank, world).backward()
                opt.step()
                opt.zero_grad()
        extra = dcp_save_or_load(net, opt, checkpoint, phase,
                                 {"control": ctl.state_dict()} if ctl is not None else None)
        if ctl is not None and phase != "save":
            ctl.load_state_dict(extra["control"])
        payloads = []
        for step in range(2, 4):
            loss_on(net, step, rank, world).backward()
            opt.step()
            opt.zero_grad()
            payloads.append(opt.export_update(net))
        finals[rule] = {"state": full_state(net), "payloads": payloads}
    return finals


def _dcp_save(rank: int, world: int, out: Path) -> None:
    torch.save(_dcp_run(rank, world, out, "save"), out / f"dcp{rank}.pt")


def _dcp_resume_worker(rank: int, world: int, out: Path) -> None:
    torch.save(_dcp_run(rank, world, out, "resume"), out / f"dcp{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{world: [per-rank records]}, and the resumed checkpoint's per-rank results."""
    out = tmp_path_factory.mktemp("distributed")
    results = {}
    for world in (2, 4):
        spawn(_matrix_worker, out / f"world{world}", world)
        results[world] = [torch.load(out / f"world{world}" / f"matrix{r}.pt",
                                     weights_only=False) for r in range(world)]
    spawn(_dcp_resume_worker, out / "resume", 2)
    results["dcp"] = [(torch.load(out / "world2" / f"dcp{r}.pt", weights_only=False),
                       torch.load(out / "resume" / f"dcp{r}.pt", weights_only=False))
                      for r in range(2)]
    return results


# ---------------------------------------------------------------- reference and bounds


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in BF16 ulps between same-sign BF16 tensors (difference of bit patterns)."""
    return (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()


def load(net: nn.Module, state: dict) -> None:
    with torch.no_grad():
        for k, v in net.state_dict().items():
            v.copy_(state[k])


def single_process_steps(scenario, world: int, pre_states: list[dict]) -> tuple[list, list, dict]:
    """The scenario's optimizer on one process, each step started from ``pre_states[s]``: the
    ranks' shares backpropagated as micro-batches (loss / world), the whole probe. Returns the
    states after each step, the controller's history and the optimizer's final state by
    parameter name."""
    rule, mode, kl = scenario
    net = build(head=not (kl and mode == "fsdp"))
    opt, ctl = make_optimizer(rule, net.parameters(), distributed=False, kl=kl)
    if ctl is not None:
        ctl.set_probe(net, probe())
    posts = []
    for step, pre in enumerate(pre_states):
        load(net, pre)
        for r in range(world):
            (loss_on(net, step, r, world) / world).backward()
        opt.step()
        opt.zero_grad()
        posts.append(full_state(net))
    state = {name: opt.state[p] for name, p in net.named_parameters() if p in opt.state}
    return posts, ctl.history if ctl is not None else None, state


def exact(scenario, world: int) -> bool:
    """Bit-identical to the single process, or only within the rounding bound.

    On 2 processes the all-reduce adds the two sketches in the order the micro-batches are
    accumulated (a + b either way), and the normalisation by a power of two is exact. Not
    bit-identical, hence the bound: on 4 processes gloo adds the four sketches in an order of
    its own; under FSDP2, RGCOptimizer's ``||W||^2`` and ``||H||^2`` are sums of the ranks'
    partial sums (another FP32 order; RowAdam's coefficients need no norm); PredictedKL's
    kappa is a float64 sum over the ranks' tokens in another order.
    """
    rule, mode, kl = scenario
    return world == 2 and not kl and (mode == "dp" or rule == "rowadam")


def assert_matches_single_process(scenario, world: int, records: list[dict]) -> int:
    """Every step against the single process; returns the elements that differed.

    The bound where the FP32 sums differ in order (about 1e-8 relative): a BF16 weight can
    only differ where stochastic rounding falls the other way, by 1 ulp, in a tiny fraction of
    elements (none is expected at this size); FP32 parameters (the head) within 1e-4 of their
    update.
    """
    reference, history, _ = single_process_steps(scenario, world, records[0]["pre"])
    differing = 0
    for step, ref in enumerate(reference):
        got, pre = records[0]["post"][step], records[0]["pre"][step]
        for r in range(1, world):
            for k, v in records[r]["post"][step].items():
                assert torch.equal(v, got[k]), (scenario, step, k, "ranks differ")
        for k in COMPRESSED:
            assert not torch.equal(got[k], pre[k]), (scenario, step, k, "did not move")
            if exact(scenario, world):
                assert torch.equal(got[k], ref[k]), (scenario, world, step, k)
                continue
            ulps = bf16_ulps(got[k], ref[k])
            assert int(ulps.max()) <= 1, (scenario, world, step, k, int(ulps.max()))
            assert int((ulps > 0).sum()) <= max(1, ulps.numel() // 100), (scenario, step, k)
            differing += int((ulps > 0).sum())
        for k in ("head.weight", "head.bias"):
            if exact(scenario, world):
                assert torch.equal(got[k], ref[k]), (scenario, world, step, k)
            else:
                moved = (ref[k] - pre[k]).abs().max()
                torch.testing.assert_close(got[k], ref[k], rtol=0, atol=float(moved) * 1e-4)
    if history is not None:
        # kappa and alpha follow the factors' FP32 bits (about 1e-7 relative on 4 processes);
        # the realised KL, of order 1e-6 from logits that differ by the step, amplifies them
        for mine, theirs in zip(records[0]["history"], history, strict=True):
            assert mine["budget"] == theirs["budget"]
            assert mine["kappa"] == pytest.approx(theirs["kappa"], rel=1e-6)
            assert mine["alpha"] == pytest.approx(theirs["alpha"], rel=1e-6)
            assert mine["realised_kl"] == pytest.approx(theirs["realised_kl"], rel=1e-4)
            # the quadratic prediction holds for these small steps
            assert 0.5 < mine["realised_kl"] / mine["predicted_kl"] < 2
        assert min(h["alpha"] for h in history) < 1.0, "the controller never scaled a step"
    return differing


# ---------------------------------------------------------------- tests


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=["-".join(
    (rule, mode, "kl" if kl else "fixed")) for rule, mode, kl in SCENARIOS])
def test_ten_steps_equal_a_single_process_on_the_whole_batch(runs, world, scenario):
    assert_matches_single_process(scenario, world, [r[scenario] for r in runs[world]])


@pytest.mark.parametrize("world", [2, 4])
def test_rowadam_moments_under_fsdp2_are_the_rows_each_rank_owns(runs, world):
    """Each rank holds ``exp_avg`` (its rows x r) and ``exp_avg_sq`` (its rows) of the rows it
    owns (torch.chunk's rule: 37 rows are 19 + 18 on 2 processes, 10 + 10 + 10 + 7 on 4; 3 rows
    leave the fourth rank none), and together they are the single process's moments after
    ten steps: bit for bit on 2 processes (the averaged sketches are exact, see ``exact``), to
    FP32 rounding on 4 (gloo's order of the four sketches)."""
    for kl in (False, True):
        scenario = ("rowadam", "fsdp", kl)
        records = [r[scenario] for r in runs[world]]
        _, _, reference = single_process_steps(scenario, world, records[0]["pre"])
        for rank, record in enumerate(records):
            for name, moments in record["moments"].items():
                d = SHAPES[name][0]
                chunk = -(-d // world)
                rows = max(0, min(chunk, d - rank * chunk))
                assert moments["exp_avg"][0] == (rows, RANK), (name, rank)
                assert moments["exp_avg_sq"][0] == (rows,), (name, rank)
                for key, (_, whole) in moments.items():
                    want = reference[name][key]
                    assert whole.shape == want.shape and whole.dtype == torch.float32
                    if world == 2:
                        assert torch.equal(whole, want), (kl, name, key)
                    else:
                        torch.testing.assert_close(whole, want, rtol=1e-5, atol=1e-12)


def test_fsdp2_resharding_after_forward_changes_nothing(runs):
    """reshard_after_forward=True frees the gathered weight that backward then needs, and
    gathers it again before backward."""
    scenario = ("rowadam", "fsdp", True)
    records = [r["reshard"] for r in runs[2]]
    assert_matches_single_process(scenario, 2, records)
    for a, b in zip(records[0]["post"], runs[2][0][scenario]["post"], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("world", [2, 4])
def test_a_receiver_of_the_payloads_ends_bit_identical(runs, world):
    """A single-process receiver applies each step's payload (rank 0's export; under FSDP2
    gathered from the row shards) and matches the trainer's whole weights after every step."""
    for scenario in SCENARIOS:
        record = runs[world][0][scenario]
        receiver = build(head=not (scenario[2] and scenario[1] == "fsdp"))
        load(receiver, record["pre"][0])
        for step, payload in enumerate(record["payloads"]):
            rgc.apply_update(receiver, payload)  # checks the fingerprints before and after
            post = record["post"][step]
            assert all(torch.equal(v, post[k]) for k, v in full_state(receiver).items()), (
                scenario, step)
            factor = payload["up_proj.weight/factor"]
            assert tuple(factor.shape) == (37, RANK)  # sketch-sized: d x r, never d x k


def _sketch_bytes(mode: str, world: int, kl: bool) -> int:
    if mode == "dp":
        return sum(d * RANK * 4 for d, _ in SHAPES.values())
    return sum(world * -(-d // world) * RANK * 4 for d, _ in SHAPES.values())


@pytest.mark.parametrize("world", [2, 4])
def test_bytes_per_step_are_the_sketches_plus_a_few_scalars(runs, world):
    """What a rank passes to collectives per step: ``sum d r 4`` bytes of sketches (FSDP2: rows
    padded to ``world ceil(d / world)``), a 4-byte presence flag per tensor, the dense
    gradients under data parallel; under FSDP2 one all-reduce of the partial sums (RGC: 3 FP32
    per parameter, ``||W||^2``, ``||H||^2``, non-finite count; RowAdam: 2 per sketched
    weight, 1 per dense one); with PredictedKL two all-reduces of 2 float64 (kappa and the
    realised KL's sums and token counts), under FSDP2 also the all-gather of the d x r
    factors (each rank its ``ceil(d / world)`` rows)."""
    head = 19 * 5 + 5
    for rule, mode, kl in SCENARIOS:
        head_trained = not (kl and mode == "fsdp")
        for rank_record in runs[world]:
            record = rank_record[rule, mode, kl]
            if mode == "dp":
                slots = 3 + 2 * head_trained
                expected = [("all_reduce", 4 * (slots + sum(d * RANK for d, _ in SHAPES.values())
                                                + head * head_trained))]
            else:
                flags = world * 3 * 4
                expected = [("reduce_scatter", _sketch_bytes(mode, world, kl) + flags)]
                normalised = rule.startswith("rgc")
                per_param = 3 if normalised else 2
                scalars = 3 * per_param + 2 * head_trained * (3 if normalised else 1)
                expected.append(("all_reduce", 4 * scalars))
                if kl:
                    expected.append(("all_gather", _sketch_bytes(mode, world, kl) // world))
            if kl:
                expected += [("all_reduce", 16), ("all_reduce", 16)]
            for step, calls in enumerate(record["calls"]):
                assert calls == expected, (rule, mode, kl, step)
                assert record["comm"][step] == sum(b for _, b in calls)
            if mode == "fsdp":  # the export all-gathers the factors (and the dense head)
                gathered = _sketch_bytes(mode, world, kl) // world + 4 * head_trained * (
                    -(-5 // world) * 19 + -(-5 // world))
                fingerprints = 8 * 2 * (3 + 2 * head_trained)
                assert set(record["export_bytes"]) == {gathered + fingerprints}
            else:
                assert set(record["export_bytes"]) == {0}


def test_sketch_traffic_is_far_below_dense_gradients(runs):
    dense = sum(d * k * 2 for d, k in SHAPES.values())  # BF16 gradients, as DDP sends them
    sketch = _sketch_bytes("dp", 2, False)
    assert dense / sketch == pytest.approx(sum(d * k for d, k in SHAPES.values()) / (
        2 * RANK * sum(d for d, _ in SHAPES.values())))
    assert dense > 2.5 * sketch


@pytest.mark.parametrize("world", [2, 4])
def test_host_reads_per_step_are_constant(runs, world):
    """No .item()/float()/bool() in an uncontrolled step; with PredictedKL two (kappa, realised
    KL), whatever the number of layers or buckets. Host copies (``tolist``): the presence
    flags of all buckets at once, and with a controller the active flags."""
    for rule, mode, kl in SCENARIOS:
        for rank_record in runs[world]:
            record = rank_record[rule, mode, kl]
            assert record["syncs"] == [2 if kl else 0] * STEPS, (rule, mode, kl)
            assert record["copies"] == [1 + kl] * STEPS, (rule, mode, kl)
    if world == 2:
        tiny, normal = runs[2][0]["tiny_buckets"], runs[2][0]["rgc", "dp", True]
        assert len(tiny["calls"][0]) > len(normal["calls"][0]) + 3  # many buckets
        assert tiny["syncs"] == normal["syncs"] and tiny["copies"] == normal["copies"]
        assert all(torch.equal(a[k], b[k]) for a, b in zip(tiny["post"], normal["post"],
                                                           strict=True) for k in a)


@pytest.mark.parametrize("rule", ["rgc", "rowadam", "rowadam-fsdp"])
def test_expert_stacks_under_data_parallel(runs, rule):
    """[E, d, k] expert weights: the averaged E x d x r sketches give every rank the single
    process's update on the whole batch, bit for bit on 2 processes, also beside FSDP2 row
    shards of the other projections; a receiver follows."""
    records = [r["experts"][rule] for r in runs[2]]
    model = _experts_model()
    name = rule.removesuffix("-fsdp")
    opt = (rgc.RGCOptimizer if name == "rgc" else rgc.RowAdam)(model.parameters(),
                                                               lr=LR[name], seed=5)
    receiver = _experts_model()
    stacks = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert stacks
    for step, pre in enumerate(records[0]["pre"]):
        load(model, pre)
        for r in range(2):
            (_expert_loss(model, step, r, 2) / 2).backward()
        opt.step()
        opt.zero_grad()
        ref, got = full_state(model), records[0]["post"][step]
        assert all(torch.equal(got[k], records[1]["post"][step][k]) for k in got)
        assert all(torch.equal(got[k], ref[k]) for k in got), step
        assert not torch.equal(got[stacks[0]], pre[stacks[0]])
        rgc.apply_update(receiver, records[0]["payloads"][step])
        assert all(torch.equal(v, got[k]) for k, v in full_state(receiver).items())


def test_dcp_save_restart_resume_is_bit_identical(runs):
    """From fresh processes and a differently initialised model: weights and sync payloads
    (their step numbers included) continue as if uninterrupted, for the LoGRA recipe (FSDP2,
    RowAdam with its row-sharded moments, annealed PredictedKL) and RGCOptimizer."""
    for straight, resumed in runs["dcp"]:
        for rule in ("rowadam", "rgc"):
            a, b = straight[rule], resumed[rule]
            assert a["state"].keys() == b["state"].keys()
            assert all(torch.equal(a["state"][k], b["state"][k]) for k in a["state"]), rule
            for pa, pb in zip(a["payloads"], b["payloads"], strict=True):
                assert pa.keys() == pb.keys()
                assert all(torch.equal(pa[k], pb[k]) for k in pa), rule


def test_mismatched_seeds_ddp_and_unservable_set_ups_are_refused(runs):
    for rank_record in runs[2]:
        messages = rank_record["refusals"]
        assert len(messages) == 7, messages
        assert "projection seeds" in messages[0] and "rounding seeds" not in messages[0]
        assert "rgc.wrap(model, rank, seed=...)" in messages[0]
        assert "rounding seeds" in messages[1] and "projection seeds" not in messages[1]
        assert "projection seeds" in messages[2]
        assert all("DistributedDataParallel" in m for m in messages[3:5])
        assert "step_control" in messages[5] and "freeze_others" in messages[5]
        assert "sharded DTensor" in messages[6] and "DistributedRGCOptimizer" in messages[6]


def _largest_tensor(rank: int, world: int) -> int:
    """Elements of the largest tensor created in backward and step under FSDP2 (both rules)."""
    largest = 0
    for rule in ("rgc", "rowadam"):
        net = _shard(build(head=False))
        opt, _ = make_optimizer(rule, net.parameters(), distributed=True, kl=False)
        for step in range(2):
            loss = loss_on(net, step, rank, world)
            with rgc.memory.track() as in_backward:
                loss.backward()
            with rgc.memory.track() as in_step:
                opt.step()
            opt.zero_grad()
            largest = max([largest] + [math.prod(a.shape) for a in
                                       in_backward.allocations + in_step.allocations])
    return largest


def test_fsdp2_never_holds_a_dense_gradient_or_update(runs):
    """Backward and step, with reshard_after_forward=False (FSDP then gathers no compressed
    weight in backward, so any tensor of d x k elements would be a gradient or an update)."""
    for rank_record in runs[2]:
        largest = rank_record["largest"]
        assert 0 < largest < min(d * k for d, k in SHAPES.values() if d > 3), largest


def _whole_batch_sketch(rank: int, world: int) -> dict:
    net = build()
    pre = full_state(net)
    loss_on(net, 0, rank, world).backward()
    sent = all_reduce_sketches(net)
    return {"pre": pre, "sketch": net.up_proj.sketch.clone(), "sent": sent,
            "projection": net.up_proj.projection.clone()}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("rule", ["rgc", "rowadam"])
def test_meta_initialised_fsdp2_run_equals_one_materialised_first(runs, world, rule):
    """Meta init -> rgc.wrap -> fully_shard -> to_empty -> set_model_state_dict -> training:
    every step's weights equal those of the model built on the CPU, bit for bit (the
    projections are made from their seeds when the module is materialised)."""
    for records in runs[world]:
        want = records[(rule, "fsdp", False)]["post"]
        for step, (got, ref) in enumerate(zip(records["meta"][rule], want, strict=True)):
            assert got.keys() == ref.keys()
            for k, v in ref.items():
                assert torch.equal(got[k], v), (rule, world, step, k)


def _float64_norm(net) -> float:
    """The norm of every pending gradient estimate, in float64: ||C P^T|| of each sketch and
    the head's gradients."""
    total = 0.0
    for _, layer in rgc.compressed_layers(net):
        total += float((layer.sketch.double() @ layer.projection.double().T).square().sum())
    total += sum(float(p.grad.double().square().sum()) for p in net.head.parameters())
    return math.sqrt(total)


@pytest.mark.parametrize("mode", ["dp", "fsdp"])
def test_clipping_uses_the_global_norm_of_the_reduced_estimates(runs, mode):
    """clip_grad_norm_ under a distributed optimizer returns the global norm (filled in by the
    step) and every rank clips by it: the norm equals a float64 norm of the single process's
    whole-batch estimates, and the weights and moments equal the single process clipping by
    the same rule (bit for bit under data parallel on 2 processes; within the rounding bound
    of the ranks' partial sums under FSDP2). The clip factor (about 1e-3) shows in the
    moments, which are far below an unclipped run's."""
    records = [r["clip"][mode] for r in runs[2]]
    net = build()
    opt, _ = make_optimizer("rowadam", net.parameters(), distributed=False, kl=False)
    free = build()
    free_opt, _ = make_optimizer("rowadam", free.parameters(), distributed=False, kl=False)
    for step, pre in enumerate(records[0]["pre"]):
        for r in (0, 1):
            assert torch.equal(records[r]["norms"][step], records[0]["norms"][step])
            for k, v in records[r]["post"][step].items():
                assert torch.equal(v, records[0]["post"][step][k]), (mode, step, k)
        for model in (net, free):
            load(model, pre)
            for r in range(2):
                (loss_on(model, step, r, 2) / 2).backward()
        want = _float64_norm(net)
        norm = opt.clip_at_step(MAX_NORM)
        opt.step()
        free_opt.step()
        opt.zero_grad()
        free_opt.zero_grad()
        got = float(records[0]["norms"][step])
        assert want > 10 * MAX_NORM
        assert got == pytest.approx(want, rel=1e-5), (mode, step)
        assert float(norm) == pytest.approx(want, rel=1e-5)
        ref = full_state(net)
        for k in COMPRESSED:
            got_w = records[0]["post"][step][k]
            if mode == "dp":
                assert torch.equal(got_w, ref[k]), (mode, step, k)
            else:
                assert int(bf16_ulps(got_w, ref[k]).max()) <= 1, (mode, step, k)
    for (name, p), q in zip(net.named_parameters(), free.parameters(), strict=True):
        if name not in COMPRESSED:
            continue
        mine = records[0]["moments"][name]["exp_avg"][1]
        clipped, unclipped = opt.state[p]["exp_avg"], free_opt.state[q]["exp_avg"]
        if mode == "dp":
            assert torch.equal(mine, clipped), name
        else:
            torch.testing.assert_close(mine, clipped, rtol=1e-5, atol=1e-12)
        assert float(clipped.norm()) < 0.1 * float(unclipped.norm()), name


def test_data_parallel_sketch_is_the_whole_batch_sketch(runs):
    """After all_reduce_sketches: C = G P, G the float64 gradient of the whole-batch loss."""
    record = runs[2][0]["sketch"]
    pre = {k: v.double() for k, v in record["pre"].items()}
    x, y = batch(0)
    w_up = pre["up_proj.weight"].clone().requires_grad_(True)
    h = torch.tanh(x.double() @ w_up.t()) @ pre["down_proj.weight"].t()
    out = torch.cat([h, h @ pre["o_proj.weight"].t()], -1) @ pre["head.weight"].t()
    (grad,) = torch.autograd.grad((out + pre["head.bias"] - y.double()).square().mean(), w_up)
    expected = grad @ record["projection"].double()
    # The forward ran in BF16, hence the loose tolerance; one rank's half-batch sketch is off
    # by O(1) of the norm.
    err = (record["sketch"].double() - expected).norm() / expected.norm()
    assert err < 3e-2, float(err)
    assert record["sent"] == 4 * (5 + sum(d * RANK for d, _ in SHAPES.values()) + 19 * 5 + 5)


# ---------------------------------------------------------------- single process


@pytest.mark.parametrize("rule", ["rgc", "rowadam"])
def test_without_process_group_it_is_the_single_process_optimizer(rule):
    a, b = build(), build()
    opt_a, _ = make_optimizer(rule, a.parameters(), distributed=False, kl=False)
    opt_b, _ = make_optimizer(rule, b.parameters(), distributed=True, kl=False)
    for step in range(2):
        for net, opt in ((a, opt_a), (b, opt_b)):
            loss_on(net, step).backward()
            opt.step()
            opt.zero_grad()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(),
                                                  b.state_dict().values(), strict=True))
    assert all_reduce_sketches(a) == 0


def test_a_shard_offloaded_to_the_host_is_refused():
    """FSDP2's CPUOffloadPolicy keeps the shards on the CPU beside a CUDA mesh (it needs an
    accelerator, so the parameter here is a stand-in with those two attributes)."""
    from types import SimpleNamespace

    from rgc.distributed import _check_not_offloaded

    offloaded = SimpleNamespace(shape=(8, 4), device=torch.device("cpu"),
                                device_mesh=SimpleNamespace(device_type="cuda"))
    with pytest.raises(NotImplementedError, match="CPUOffloadPolicy.*without offload_policy"):
        _check_not_offloaded(offloaded)
    _check_not_offloaded(SimpleNamespace(shape=(8, 4), device=torch.device("cpu"),
                                         device_mesh=SimpleNamespace(device_type="cpu")))


def test_bad_arguments():
    with pytest.raises(ValueError, match="bucket_mb"):
        DistributedRGCOptimizer(build().parameters(), lr=0.1, bucket_mb=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        DistributedRowAdam(build().parameters(), lr=0.1, bucket_mb=True)
    with pytest.raises(ValueError, match="bucket_mb"):
        all_reduce_sketches(build(), bucket_mb=-1)
    with pytest.raises(TypeError, match="nn.Module or an optimizer"):
        all_reduce_sketches(object())


def test_a_zero_dense_gradient_on_a_sketched_weight_is_a_zero_sketch_and_others_raise():
    """torch.distributed.checkpoint builds its load template with a step on zero .grad of every
    trainable parameter and lr = 0: a sketched weight then takes a zero sketch (RowAdam's
    moments get their sketch shape) and no parameter changes. A non-zero dense gradient there
    is refused, before any change."""
    net = build()
    opt, _ = make_optimizer("rowadam", net.parameters(), distributed=True, kl=False)
    for p in net.parameters():
        p.grad = torch.zeros_like(p)
    for group in opt.param_groups:  # as torch.distributed.checkpoint's template step does
        group["lr"] = 0.0
    before = full_state(net)
    opt.step()
    assert tuple(opt.state[net.up_proj.weight]["exp_avg"].shape) == (37, RANK)
    assert net.up_proj.weight.grad is None
    assert all(torch.equal(v, before[k]) for k, v in full_state(net).items())
    for group in opt.param_groups:
        group["lr"] = LR["rowadam"]
    opt.zero_grad()
    net.up_proj.weight.grad = torch.ones_like(net.up_proj.weight)
    with pytest.raises(RuntimeError, match="non-zero dense .grad"):
        opt.step()
    assert all(torch.equal(v, before[k]) for k, v in full_state(net).items())


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
    apply_lowrank_update_(whole, sketch, projection, 0.3, decay=0.01, seed=seed)
    chunk = -(-d // world)
    for start in range(0, d, chunk):
        rows = slice(start, start + chunk)
        apply_lowrank_update_(pieces[rows], sketch[rows], projection, 0.3, decay=0.01,
                              seed=seed, offset=start * k)
    assert torch.equal(whole, pieces)
    assert not torch.equal(whole, weight)


#: What a rank prints when torch's C++ distributed teardown calls ``std::terminate`` on its
#: way out. It came after the example had printed its last line, in 1 of 380 runs here with
#: three or four runs at once (and in one CI run): the training and the checks were done.
TEARDOWN_ABORT = "terminate called without an active exception"


def _torchrun_example(workdir: Path, args: list[str]):
    """``examples/distributed.py --steps 2 *args`` on two torchrun processes, in ``workdir``."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1",  # see _entry
               PYTHONPATH=os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")]))
    workdir.mkdir()
    return subprocess.run(
        # --standalone: a free port for the rendezvous (another run may hold the default)
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(root / "examples" / "distributed.py"), "--steps", "2", *args],
        capture_output=True, text=True, timeout=TIMEOUT_S, env=env, cwd=workdir)


@pytest.mark.parametrize("recipe", [False, True], ids=["rgc-data-parallel", "logra-fsdp2"])
def test_example_runs_under_torchrun(tmp_path, recipe):
    """examples/distributed.py as documented: data parallel with RGCOptimizer, and the LoGRA
    recipe (FSDP2, RowAdam, annealed PredictedKL) with a DCP checkpoint (2 steps each).

    A run that printed all of its output and then aborted on exit (:data:`TEARDOWN_ABORT`)
    is run once more; any other failure, or a second abort, fails."""
    for attempt in (1, 2):
        run_dir = tmp_path / f"run{attempt}"
        args = (["--recipe", "logra", "--checkpoint", str(run_dir / "ckpt")] if recipe
                else ["--recipe", "rgc"])
        result = _torchrun_example(run_dir, args)
        finished = "weights agree across ranks: True" in result.stdout and (
            not recipe or "saved" in result.stdout)
        if result.returncode == 0 or not finished or TEARDOWN_ABORT not in result.stderr:
            break
    assert result.returncode == 0, result.stdout + result.stderr
    assert finished, result.stdout
    if recipe:
        assert "predicted KL" in result.stdout
        assert (run_dir / "ckpt" / ".metadata").exists()
