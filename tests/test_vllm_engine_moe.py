"""rgc payloads with expert stacks pushed into a real vLLM engine in this process (skipped
without vLLM).

A tiny Qwen3-MoE (4 experts of width 32, 2 per token; BF16 and FP32) trained 20 steps with
RGCOptimizer and with RowAdam (weight decay), its experts sketched as ``[E, d, k]`` stacks, the
embedding and a norm trained densely; every step is pushed as a payload. vLLM keeps the experts
in its fused-MoE layer (``w13_weight`` = gate and up, ``w2_weight`` = down), which its CPU
kernels store prepacked for their grouped GEMM (BF16 in the AMX kernel's order where the CPU
has AMX, FP32 in the vector kernel's). After every step the engine's ``w13``/``w2`` equal the
trainer's ``gate_up_proj``/``down_proj`` packed by the engine's own prepack op, and every other
tensor the trainer's (cut from the fused layers as in ``test_vllm_engine.py``), bit for bit. At
the end the engine generates exactly what a new engine loaded from the trainer's checkpoint
generates, and what the trainer model predicts. Refused payloads leave every engine parameter
as it was.
"""

from __future__ import annotations

import pytest
import torch

import tests.vllm_engine  # noqa: F401  (before vLLM: its logging set-up)

pytest.importorskip("vllm")

import rgc  # noqa: E402
from rgc.integrations.vllm import push_update, push_weights, read_weights  # noqa: E402
from rgc.payload import decode, payload_checksum  # noqa: E402
from tests.test_vllm_engine import engine_model, engine_tensors  # noqa: E402
from tests.vllm_engine import (  # noqa: E402
    assert_generations_match_trainer,
    assert_step_order_refusals_then_resync,
    greedy,
    load_moe_trainer,
    make_trainer,
    save_moe_base,
    start_engine,
    train_step,
)

STEPS = 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
DENSE = ("model.embed_tokens.weight", "model.norm.weight")
_FUSED = {"gate_up_proj": "w13_weight", "down_proj": "w2_weight"}


@pytest.fixture(scope="module", params=list(DTYPES))
def setup(request, tmp_path_factory):
    """(checkpoint, dtype, engine) of one dtype."""
    dtype = DTYPES[request.param]
    base = save_moe_base(tmp_path_factory.mktemp(f"qwen3_moe_{request.param}") / "base", dtype)
    return base, dtype, start_engine(base, dtype)


def trainer(base, dtype, opt_name):
    return make_trainer(base, dtype, opt_name, load=load_moe_trainer, dense=DENSE)


def packed(routed, t: torch.Tensor) -> torch.Tensor:
    """A plain ``[E, D, K]`` stack as the engine's fused-MoE backend stores it."""
    experts = routed.quant_method.moe_kernel.fused_experts
    if not hasattr(experts, "isa") or getattr(experts, "_use_zentorch", False):
        return t
    from vllm._custom_ops import cpu_prepack_moe_weight

    return cpu_prepack_moe_weight(t.contiguous(), experts.isa)


def assert_engine_equals(llm, model, when):
    engine = engine_model(llm)
    tensors = engine_tensors(llm, model.config)
    checked = 0
    for name, p in model.named_parameters():
        stem, _, attr = name.rpartition(".")
        if attr in _FUSED:
            routed = engine.get_submodule(stem).routed_experts
            got, want = getattr(routed, _FUSED[attr]).detach(), packed(routed, p.detach())
            checked += 1
        else:
            got, want = tensors[name], p.detach()
        assert got.dtype == want.dtype
        assert torch.equal(got, want), f"{name} differs {when}"
    assert checked == 2 * model.config.num_hidden_layers


@pytest.mark.parametrize("opt_name", ["rgc", "rowadam"])
def test_engine_experts_and_generations_follow_the_trainer(setup, opt_name, tmp_path):
    base, dtype, llm = setup
    model, opt = trainer(base, dtype, opt_name)
    full = push_weights(llm, model)
    assert_engine_equals(llm, model, "after push_weights")
    names = [n for n, _ in model.named_parameters()]
    sent, stacks = [], 0
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
        payload = opt.export_update(model)
        stacks += sum(e.stack is not None for e in decode(payload).entries)
        sent.append(push_update(llm, payload))
        assert_engine_equals(llm, model, f"after step {step}")
    read = read_weights(llm, names)
    for name, p in model.named_parameters():
        assert torch.equal(read[name].reshape(p.shape), p.detach()), name
    assert stacks == STEPS * 2 * model.config.num_hidden_layers
    start = dict(load_moe_trainer(base, dtype).named_parameters())
    moved = {n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])}
    assert {n for n in moved if n.rpartition(".")[2] in _FUSED} == {
        n for n in start if n.rpartition(".")[2] in _FUSED}
    assert max(sent) < full / 2

    synced = greedy(llm)
    rgc.unwrap(model)
    model.save_pretrained(tmp_path / "trained")
    for file in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "trained" / file).write_bytes((base / file).read_bytes())
    assert greedy(start_engine(tmp_path / "trained", dtype)) == synced
    assert_generations_match_trainer(model, base, synced,
                                     tol=2e-4 if dtype == torch.float32 else 6e-2)


def test_refused_expert_payloads_leave_the_engine_unchanged(setup):
    base, dtype, llm = setup
    model, opt = trainer(base, dtype, "rowadam")
    push_weights(llm, model, step=0)
    engine = engine_model(llm)

    def unchanged(call, error, match):
        before = {n: p.detach().clone() for n, p in engine.named_parameters()}
        with pytest.raises(error, match=match):
            call()
        after = dict(engine.named_parameters())
        assert all(torch.equal(before[n], after[n]) for n in before)

    train_step(model, opt, 1)
    payload = opt.export_update(model)
    key = "model.layers.1.mlp.experts.down_proj/factor"
    tampered = dict(payload)
    tampered[key] = payload[key] * 1.5
    unchanged(lambda: push_update(llm, tampered), ValueError, "checksum")
    # the same change with a recomputed checksum: the check pass finds other bits
    tampered["rgc/checksum"] = payload_checksum(tampered)
    unchanged(lambda: push_update(llm, tampered), RuntimeError, "other bits")
    # an expert's coefficient changed: only that expert's blocks differ
    coef = "model.layers.0.mlp.experts.gate_up_proj/coef"
    one = dict(payload)
    one[coef] = payload[coef].clone()
    one[coef][int(payload[coef].abs().argmax())] *= 2
    one["rgc/checksum"] = payload_checksum(one)
    unchanged(lambda: push_update(llm, one), RuntimeError, "other bits")

    push_update(llm, payload)
    assert_step_order_refusals_then_resync(llm, model, opt, load_moe_trainer(base, dtype),
                                           unchanged, assert_engine_equals)
