"""rgc payloads pushed into a vLLM engine with tensor parallelism 2 (skipped without vLLM).

The engine runs in its own process with one worker process per rank, so payloads travel as a
file in shared memory. Two query heads and one key/value head: each rank holds one query
head and both hold the key/value head (replicated); ``o_proj``/``down_proj`` are split by
columns; the 66-token embedding and head by vocabulary rows (64 and 2, padded to 64 each);
``chunk_rows=20`` puts the ranks' row boundaries inside the trainer's chunks. After every one
of 20 steps each rank's own tensors (vLLM's ``save_sharded_state``), cut here by that layout,
equal the trainer's bit for bit.
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
    make_trainer,
    save_base,
    start_engine,
    train_step,
)

TP = 2
STEPS = 20


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    base = save_base(tmp_path_factory.mktemp("qwen3_tp") / "base", torch.bfloat16)
    return base, start_engine(base, torch.bfloat16, tensor_parallel_size=TP)


def expected_shard(name: str, t: torch.Tensor, rank: int, config) -> torch.Tensor:
    """Rank ``rank``'s part of trainer tensor ``name`` (vLLM's tensor-parallel layout)."""
    rows = {"q_proj": config.num_attention_heads * config.head_dim // TP,
            "gate_proj": config.intermediate_size // TP, "up_proj": config.intermediate_size // TP}
    layer = name.split(".")[-2]
    if layer in rows:
        return t[rank * rows[layer]:(rank + 1) * rows[layer]]
    if layer in ("o_proj", "down_proj"):
        cols = t.shape[1] // TP
        return t[:, rank * cols:(rank + 1) * cols]
    if layer in ("embed_tokens", "lm_head"):
        return t[rank * 64:(rank + 1) * 64]
    return t  # k_proj, v_proj (one head, replicated) and the norms


def engine_shards(llm, path) -> list[dict[str, torch.Tensor]]:
    """Each rank's parameters under vLLM's names, as the engine saves them."""
    from safetensors.torch import load_file

    path.mkdir()
    llm.collective_rpc("save_sharded_state", args=(str(path), "rank-{tp_rank}.safetensors"))
    return [load_file(path / f"rank-{r}.safetensors") for r in range(TP)]


def assert_shards_equal(llm, model, path, when):
    config = model.config
    q = config.num_attention_heads * config.head_dim // TP
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size // TP
    for rank, engine in enumerate(engine_shards(llm, path)):
        for name, p in model.named_parameters():
            stem, layer = name.rsplit(".", 2)[0], name.split(".")[-2]
            if layer in ("q_proj", "k_proj", "v_proj"):
                fused = engine[f"{stem}.qkv_proj.weight"]
                got = {"q_proj": fused[:q], "k_proj": fused[q:q + kv],
                       "v_proj": fused[q + kv:]}[layer]
            elif layer in ("gate_proj", "up_proj"):
                fused = engine[f"{stem}.gate_up_proj.weight"]
                got = fused[:inter] if layer == "gate_proj" else fused[inter:]
            elif layer in ("embed_tokens", "lm_head"):
                rows = min(64, config.vocab_size - rank * 64)
                got = engine[name][:rows]
                assert not engine[name][rows:].any(), f"{name}: padding rows changed"
            else:
                got = engine[name]
            want = expected_shard(name, p.detach(), rank, config)
            assert torch.equal(got, want), f"{name} on rank {rank} differs {when}"


def test_tensor_parallel_engine_follows_the_trainer(setup, tmp_path):
    base, llm = setup
    model, opt = make_trainer(base, torch.bfloat16, "rowadam", chunk_rows=20)
    push_weights(llm, model)
    assert_shards_equal(llm, model, tmp_path / "start", "after push_weights")
    sizes = []
    for step in range(1, STEPS + 1):
        train_step(model, opt, step)
        payload = opt.export_update(model)
        sizes.append(push_update(llm, payload))
        assert_shards_equal(llm, model, tmp_path / f"step{step}", f"after step {step}")
    # the bytes sent are the shared-memory file's: the payload and a header (JSON, per key)
    nbytes = sum(t.numel() * t.element_size() for t in payload.values())
    assert nbytes < sizes[-1] < nbytes + 160 * len(payload)
    names = [n for n, _ in model.named_parameters()]
    read = read_weights(llm, names)
    assert all(torch.equal(read[n].reshape(p.shape), p.detach())
               for n, p in model.named_parameters())
    assert_generations_match_trainer(model, base, greedy(llm), tol=6e-2)

    before = engine_shards(llm, tmp_path / "before")
    train_step(model, opt, STEPS + 1)
    train_step(model, opt, STEPS + 2)
    with pytest.raises(ValueError, match="wrong step order"):
        push_update(llm, opt.export_update(model))
    after = engine_shards(llm, tmp_path / "after")
    assert all(torch.equal(b[n], a[n]) for b, a in zip(before, after) for n in b)
