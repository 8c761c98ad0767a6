"""torch.compile of a wrapped model: no graph break, no recompile from rgc, eager's results.

The compiled run uses the ``aot_eager`` backend: dynamo captures the graphs and AOTAutograd
traces the backward (both are where rgc could break or recompile) without paying for
inductor's code generation on a small CPU runner. Tolerance: FP32 weights, float
reassociation only, so losses and weights agree to rtol = atol = 1e-5 after two steps.
"""

import copy
import logging

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import rgc
from tests.models import tiny_moe, tiny_qwen3


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Not again afterwards: after a reset every later test's first call of each of rgc's
    # compiled CPU loops traces it again (~2 s); none needs dynamo's caches empty.
    torch._dynamo.reset()


def train(model, ids, steps):
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses)


@pytest.mark.slow
def test_compiled_wrapped_model_matches_eager_without_breaks_or_recompiles():
    model = rgc.wrap(tiny_qwen3(num_hidden_layers=1), rank=4)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=gen)

    explanation = torch._dynamo.explain(lambda x: model(x, labels=x).loss)(ids)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
    torch._dynamo.reset()

    twin = copy.deepcopy(model)
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(twin, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = train(compiled, ids, steps=2)  # every step refreshes P and rewrites every W
    assert counter.frame_count == 1
    want = train(model, ids, steps=2)
    assert got[-1] < got[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-5, msg=name)


class _DynamoRecords(logging.Handler):
    """Dynamo's recompile and graph-break log records."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


@pytest.mark.slow
@pytest.mark.parametrize("family, backend", [("dense", "inductor"), ("moe", "aot_eager"),
                                             ("moe", "inductor")])
def test_rgc_never_shows_in_the_dynamo_logs_of_a_users_compiled_model(family, backend):
    """A user's ``torch.compile(model)`` with ``error_on_recompile``: six forward, backward and
    step iterations (every step refreshes P and runs rgc's compiled CPU loops) raise nothing,
    and no recompile or graph break names rgc. (A dense model under aot_eager: the test
    above.)"""
    if family == "dense":
        model = rgc.wrap(tiny_qwen3(num_hidden_layers=1), rank=4)
    else:
        model = rgc.wrap(tiny_moe("qwen3_moe", layers=1), rank=4)
    ids = torch.randint(0, model.config.vocab_size, (2, 8),
                        generator=torch.Generator().manual_seed(4))
    records = _DynamoRecords()
    logger = logging.getLogger("torch._dynamo")
    torch._logging.set_logs(recompiles=True, graph_breaks=True)
    logger.addHandler(records)
    try:
        compiled = torch.compile(model, backend=backend)
        with torch._dynamo.config.patch(error_on_recompile=True):
            losses = train(compiled, ids, steps=6)
    finally:
        logger.removeHandler(records)
        torch._logging.set_logs()
    assert torch.isfinite(losses).all() and losses[-1] < losses[0]
    named = [m for m in records.messages if "rgc" in m]
    assert not named, named
