"""``step()`` does not synchronise the host with the device.

A host read of a device value (``.item()``, ``float(t)``, ``bool(t)``, ``if t == 0``) runs
``aten._local_scalar_dense``; :class:`CountSyncs` counts those calls under a
``TorchDispatchMode`` on CPU models, where the same code paths run as on a GPU. A read made in
a branch taken only for CPU tensors (its source line tests ``.device.type == "cpu"``) is not a
device synchronisation and is reported apart.
"""

from __future__ import annotations

import linecache
import traceback
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import rgc
from rgc.ops import run_under_mode
from tests.models import TinyBlockLM

_CPU_ONLY = '.device.type == "cpu"'


class CountSyncs(TorchDispatchMode):
    """Call sites (``file:line`` of the innermost rgc frame) of every ``_local_scalar_dense``.

    ``syncs`` holds those that would synchronise a GPU, ``cpu_only`` those in CPU-only branches.
    """

    def __init__(self):
        super().__init__()
        self.syncs: Counter = Counter()
        self.cpu_only: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "rgc":  # look inside rgc's operators too
            return run_under_mode(self, func, args, kwargs)
        if func is torch.ops.aten._local_scalar_dense.default:
            frames = [f for f in traceback.extract_stack() if "/rgc/" in f.filename]
            frame = frames[-1] if frames else traceback.extract_stack()[-2]
            site = f"{frame.filename.rsplit('/', 2)[-1]}:{frame.lineno} ({frame.name})"
            line = linecache.getline(frame.filename, frame.lineno)
            (self.cpu_only if _CPU_ONLY in line else self.syncs)[site] += 1
        return func(*args, **(kwargs or {}))


def _model(layers: int, dtype: torch.dtype, preset: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = TinyBlockLM(layers=layers, dtype=dtype)
    return rgc.wrap(model, rank=3, preset=preset, seed=seed, freeze_others=False)


def _backward(model: nn.Module, step: int, nonfinite: bool = False) -> None:
    ids = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(step))
    model(ids).float().logsumexp(-1).mean().backward()
    if nonfinite:  # one layer's sketch and one dense gradient are not finite this step
        model.blocks[0].q_proj.sketch[0, 0] = float("nan")
        model.blocks[-1].norm.weight.grad[0] = float("inf")


def _count_steps(model, opt, steps=3) -> CountSyncs:
    """Three steps, the second with a non-finite sketch and gradient; syncs of step() only."""
    counter = CountSyncs()
    for step in range(steps):
        _backward(model, step, nonfinite=step == 1)
        with counter:
            opt.step()
        opt.zero_grad()
    return counter


OPTIMIZERS = [
    pytest.param(lambda ps: rgc.RGCOptimizer(ps, lr=1e-2), "rgc", id="rgc"),
    pytest.param(lambda ps: rgc.RGCOptimizer(ps, lr=1e-2, keep_updates=True), "rgc",
                 id="rgc-keep_updates"),
    pytest.param(lambda ps: rgc.RowAdam(ps, lr=1e-2), "logra", id="rowadam-logra"),
    pytest.param(lambda ps: rgc.RowAdam(ps, lr=1e-2, weight_decay=0.1), "rgc",
                 id="rowadam-refresh-decay"),
]


@pytest.mark.parametrize("make, preset", OPTIMIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layers", [2, 4])
def test_step_reads_nothing_on_the_host(make, preset, dtype, layers):
    model = _model(layers, dtype, preset)
    opt = make(model.parameters())
    counter = _count_steps(model, opt)
    assert not counter.syncs, dict(counter.syncs)
    if dtype == torch.float32:  # FP32 weights are stored as they are: no rounding at all
        assert not counter.cpu_only
    # the skips of step 2 were counted on the device and are read here
    q = model.blocks[0].q_proj.weight
    assert int(opt.state[q]["skipped"]) == 1
    assert int(opt.state[model.blocks[-1].norm.weight]["skipped"]) == 1
    with pytest.warns(RuntimeWarning, match="non-finite"):
        assert opt.skipped_updates() == 2


def test_counter_sees_a_host_read():
    """The counter itself: a bool() inside step() is seen (the test above can fail)."""
    model = _model(2, torch.float32, "rgc")
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-2)
    count_skips = opt._count_skips

    def syncing_count_skips(entries, ok):
        count_skips(entries, ok)
        for row in ok:
            bool(row.all())

    opt._count_skips = syncing_count_skips
    counter = _count_steps(model, opt, steps=1)
    assert sum(counter.syncs.values()) == len(opt.state) > 0  # one per updated parameter


@pytest.mark.parametrize("opt_cls, preset", [(rgc.RGCOptimizer, "rgc"), (rgc.RowAdam, "logra")])
def test_predicted_kl_reads_a_constant_number_per_step(opt_cls, preset):
    counts = []
    for layers in (2, 4):
        model = _model(layers, torch.float32, preset)
        ctl = rgc.PredictedKL(budget=1e-4, final_budget=None)
        opt = opt_cls(model.parameters(), lr=1e-2, step_control=ctl)
        probe = torch.randint(0, 32, (2, 6), generator=torch.Generator().manual_seed(9))
        ctl.set_probe(model, probe)
        counter = _count_steps(model, opt)
        counts.append(sum(counter.syncs.values()))
        assert len(ctl.history) == 3
        assert int(opt.state[model.blocks[0].q_proj.weight]["skipped"]) == 1
    # per step: kappa and the realised KL (the active flags are one .tolist(), which does not
    # go through _local_scalar_dense); none per layer
    assert counts == [2 * 3, 2 * 3], counts


@pytest.mark.skipif(not dist.is_available(), reason="torch.distributed unavailable")
def test_distributed_optimizer_fsdp2_single_process_reads_nothing(tmp_path):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0,
                            world_size=1)
    try:
        for layers in (2, 4):
            model = _model(layers, torch.bfloat16, "rgc")
            fully_shard(model)  # every weight a Shard(0) DTensor: the sharded update path
            opt = rgc.DistributedRGCOptimizer(model.parameters(), lr=1e-2)
            counter = _count_steps(model, opt)
            assert not counter.syncs, dict(counter.syncs)
            q = model.blocks[0].q_proj.weight
            assert isinstance(q, DTensor)  # the sharded path ran
            assert int(opt.state[q]["skipped"]) == 1
    finally:
        dist.destroy_process_group()
