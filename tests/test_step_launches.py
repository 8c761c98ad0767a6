"""An optimizer step's kernel launches do not grow with the number of layers of one shape.

Counted on the CPU with the Triton kernels in Triton's interpreter (``RGC_IMPL=triton``,
``TRITON_INTERPRET=1``) and every torch op that would be a CUDA kernel
(:class:`tests.launches.CountLaunches`), for models of 2 and 4 identical decoder blocks.
"""

import importlib
import sys

import pytest
import torch

import rgc
from tests.launches import CountLaunches
from tests.models import TinyBlockLM

pytest.importorskip("triton")
pytestmark = pytest.mark.slow  # whole models' steps in Triton's interpreter


@pytest.fixture(scope="module", autouse=True)
def _triton_interpreted():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")
        mp.setenv("RGC_IMPL", "triton")
        importlib.reload(sys.modules["rgc.ops.triton"]) if "rgc.ops.triton" in sys.modules \
            else importlib.import_module("rgc.ops.triton")
        yield
    importlib.reload(sys.modules["rgc.ops.triton"])


def _launches_of_a_step(layers: int, make, preset: str) -> CountLaunches:
    torch.manual_seed(0)
    model = rgc.wrap(TinyBlockLM(hidden=16, inter=32, layers=layers, dtype=torch.bfloat16),
                     rank=4, preset=preset)
    opt = make(model.parameters())
    ids = torch.randint(0, 32, (2, 5))
    for _ in range(2):  # the second step: cached norms, RowAdam's moments exist
        model(ids).float().logsumexp(-1).mean().backward()
        with CountLaunches() as count:
            opt.step()
        opt.zero_grad()
    return count


@pytest.mark.parametrize("make, preset", [
    (lambda ps: rgc.RGCOptimizer(ps, lr=1e-2), "rgc"),
    (lambda ps: rgc.RowAdam(ps, lr=1e-3), "logra"),
    (lambda ps: rgc.RowAdam(ps, lr=1e-3, weight_decay=0.1, maximize=True), "logra"),
], ids=["rgc", "rowadam", "rowadam-decay-maximize"])
def test_a_step_launches_as_many_kernels_for_4_layers_as_for_2(make, preset):
    two, four = _launches_of_a_step(2, make, preset), _launches_of_a_step(4, make, preset)
    assert two.triton > 0 and two.host_reads == four.host_reads == 0
    assert four.total == two.total, (two.names, four.names)
