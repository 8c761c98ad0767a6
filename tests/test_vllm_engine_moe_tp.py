"""rgc payloads with expert stacks pushed into a vLLM engine with tensor parallelism 2.

The engine runs in its own process with one worker per rank. A tiny Qwen3-MoE whose experts
are 64 wide, so that each rank holds rows (gate, up) and columns (down) 32 wide of every
expert, the width vLLM's CPU MoE kernels take unpadded. After every one of 10 RowAdam steps
the weights reassembled from the ranks' pieces (``read_weights``: each rank reads its blocks
through its own storage order) equal the trainer's bit for bit; at the end the engine's
greedy completions match the trainer model. (The placement of each rank's blocks against
vLLM's own loader is tested without an engine in ``tests/test_vllm_engine_moe_layout.py``.)
"""

from __future__ import annotations

import pytest
import torch

import tests.vllm_engine  # noqa: F401  (before vLLM: its logging set-up)

pytest.importorskip("vllm")

from rgc.integrations.vllm import push_update, push_weights, read_weights  # noqa: E402
from tests.vllm_engine import (  # noqa: E402
    assert_generations_match_trainer,
    greedy,
    load_moe_trainer,
    make_trainer,
    save_moe_base,
    start_engine,
    train_step,
)

STEPS = 10


def test_tensor_parallel_engine_follows_the_trainers_experts(tmp_path):
    base = save_moe_base(tmp_path / "base", torch.bfloat16, moe_intermediate_size=64)
    llm = start_engine(base, torch.bfloat16, tensor_parallel_size=2)
    model, opt = make_trainer(base, torch.bfloat16, "rowadam", chunk_rows=20,
                              load=load_moe_trainer, dense=())
    names = [n for n, _ in model.named_parameters()]
    stacks = [n for n, p in model.named_parameters() if p.dim() == 3]
    assert len(stacks) == 4
    push_weights(llm, model)
    for step in range(1, STEPS + 1):
        before = {n: model.get_parameter(n).detach().clone() for n in stacks}
        train_step(model, opt, step)
        assert all(not torch.equal(before[n], model.get_parameter(n)) for n in stacks)
        push_update(llm, opt.export_update(model))
        read = read_weights(llm, names)
        for n, p in model.named_parameters():
            assert torch.equal(read[n].reshape(p.shape), p.detach()), (step, n)
    assert_generations_match_trainer(model, base, greedy(llm), tol=6e-2)
