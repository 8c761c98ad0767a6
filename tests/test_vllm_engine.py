"""rgc payloads pushed into a real vLLM engine in this process (skipped without vLLM).

A tiny Qwen3 trained 20 steps, BF16 and FP32, with RGCOptimizer and RowAdam (weight decay),
the embedding and two norms trained densely; every step is pushed as a payload. After every
step the engine's own tensors, split here into q/k/v and gate/up by the layout vLLM documents
(rows of ``qkv_proj`` = q, k, v; of ``gate_up_proj`` = gate, up; the vocabulary rows of the
padded embedding and head), equal the trainer's bit for bit. At the end the engine generates
exactly what a new engine loaded from the trainer's checkpoint generates, and what the trainer
model predicts.
"""

from __future__ import annotations

import pytest
import torch

import tests.vllm_engine  # noqa: F401  (before vLLM: its logging set-up)

pytest.importorskip("vllm")

import rgc  # noqa: E402
from rgc.integrations.vllm import push_update, push_weights, read_weights  # noqa: E402
from rgc.payload import payload_checksum  # noqa: E402
from tests.vllm_engine import (  # noqa: E402
    DENSE,
    assert_generations_match_trainer,
    assert_step_order_refusals_then_resync,
    greedy,
    load_trainer,
    make_trainer,
    save_base,
    start_engine,
    train_step,
)

STEPS = 20
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@pytest.fixture(scope="module", params=list(DTYPES))
def setup(request, tmp_path_factory):
    """(checkpoint, dtype, engine) of one dtype."""
    dtype = DTYPES[request.param]
    base = save_base(tmp_path_factory.mktemp(f"qwen3_{request.param}") / "base", dtype)
    return base, dtype, start_engine(base, dtype)


def engine_model(llm):
    return llm.llm_engine.model_executor.driver_worker.worker.model_runner.model


def engine_tensors(llm, config) -> dict[str, torch.Tensor]:
    """The engine's tensors under the trainer's names, cut from its fused parameters."""
    params = dict(engine_model(llm).named_parameters())
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter, vocab = config.intermediate_size, config.vocab_size
    out = {}
    for name, t in params.items():
        t = t.detach()
        if name.endswith("qkv_proj.weight"):
            stem = name.removesuffix("qkv_proj.weight")
            parts = {"q": t[:q], "k": t[q:q + kv], "v": t[q + kv:q + 2 * kv]}
            out.update({f"{stem}{p}_proj.weight": v for p, v in parts.items()})
        elif name.endswith("gate_up_proj.weight"):
            stem = name.removesuffix("gate_up_proj.weight")
            out[f"{stem}gate_proj.weight"], out[f"{stem}up_proj.weight"] = t[:inter], t[inter:]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = t[:vocab]
        else:
            out[name] = t
    return out


def assert_engine_equals(llm, model, when):
    engine = engine_tensors(llm, model.config)
    trainer = dict(model.named_parameters())
    assert set(engine) == set(trainer)
    for name, p in trainer.items():
        assert engine[name].dtype == p.dtype
        assert torch.equal(engine[name], p.detach()), f"{name} differs {when}"


@pytest.mark.parametrize("opt_name", ["rgc", "rowadam"])
def test_engine_weights_and_generations_follow_the_trainer(setup, opt_name, tmp_path):
    base, dtype, llm = setup
    model, opt = make_trainer(base, dtype, opt_name)
    full = push_weights(llm, model)
    assert full == sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert_engine_equals(llm, model, "after push_weights")
    names = [n for n, _ in model.named_parameters()]
    sent = []
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
        sent.append(push_update(llm, opt.export_update(model)))
        assert_engine_equals(llm, model, f"after step {step}")
        if step in (1, STEPS):
            read = read_weights(llm, names)
            for name, p in model.named_parameters():
                assert torch.equal(read[name].reshape(p.shape), p.detach()), name
    start = dict(load_trainer(base, dtype).named_parameters())
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), start[n])]
    assert len(moved) == 2 * 7 + len(DENSE)
    assert max(sent) < full / 2

    # What the engine generates: the same as a new engine on the trainer's checkpoint ...
    synced = greedy(llm)
    rgc.unwrap(model)
    model.save_pretrained(tmp_path / "trained")
    (tmp_path / "trained" / "tokenizer.json").write_bytes((base / "tokenizer.json").read_bytes())
    (tmp_path / "trained" / "tokenizer_config.json").write_bytes(
        (base / "tokenizer_config.json").read_bytes())
    assert greedy(start_engine(tmp_path / "trained", dtype)) == synced
    # ... and what the trainer model predicts
    assert_generations_match_trainer(model, base, synced,
                                     tol=2e-4 if dtype == torch.float32 else 6e-2)


def test_refused_payloads_leave_the_engine_unchanged(setup):
    base, dtype, llm = setup
    model, opt = make_trainer(base, dtype, "rowadam")
    push_weights(llm, model, step=0)
    names = [n for n, _ in model.named_parameters()]

    def unchanged(call, error, match):
        before = read_weights(llm, names)
        with pytest.raises(error, match=match):
            call()
        after = read_weights(llm, names)
        assert all(torch.equal(before[n], after[n]) for n in names)

    train_step(model, opt, 1)
    payload = opt.export_update(model)
    tampered = dict(payload)
    tampered["model.layers.1.mlp.up_proj.weight/factor"] = payload[
        "model.layers.1.mlp.up_proj.weight/factor"] * 1.5
    unchanged(lambda: push_update(llm, tampered), ValueError, "checksum")
    # the same change with a recomputed checksum: the check pass finds other bits
    tampered["rgc/checksum"] = payload_checksum(tampered)
    unchanged(lambda: push_update(llm, tampered), RuntimeError, "other bits")
    wrong_dtype = dict(payload)
    name = "model.layers.0.self_attn.q_proj.weight"
    options = payload[f"{name}/options"].clone()
    options[2] = 1 - options[2]
    wrong_dtype[f"{name}/options"] = options
    wrong_dtype["rgc/checksum"] = payload_checksum(wrong_dtype)
    unchanged(lambda: push_update(llm, wrong_dtype), ValueError, "dtype")
    unknown = {k.replace("layers.1.", "layers.7.") if k.startswith("model.layers.1.") else k: v
               for k, v in payload.items()}
    unknown["rgc/checksum"] = payload_checksum(unknown)
    unchanged(lambda: push_update(llm, unknown), ValueError, "no parameter")

    push_update(llm, payload)
    assert_step_order_refusals_then_resync(llm, model, opt, load_trainer(base, dtype), unchanged,
                                           assert_engine_equals)



def test_cpu_loops_compile_beside_vllm():
    """With vLLM imported, rgc's compiled CPU loops still compile (a loop given one tensor twice
    once fell back to eager ops here when its arguments were detached one by one), and round
    as the int64 statement of the rule does: add the low 16 hash bits, keep the upper half."""
    import warnings

    from rgc.bits import random_bits

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    out = torch.empty(1000, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        torch.ops.rgc.stochastic_round_(out, x, 3, 0)
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    want = ((bits + (random_bits(1000, seed=3) & 0xFFFF)) >> 16) & 0xFFFF
    assert torch.equal(out.view(torch.int16).to(torch.int64) & 0xFFFF, want)
