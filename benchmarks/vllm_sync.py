"""Sync into a vLLM engine per training step: rgc payload vs full-weight reload.

Measured (needs vLLM; ``.venv-vllm`` from ``scripts/setup_vllm.sh``): a tiny and a small
Qwen3 (BF16, r=8 and r=32) trained with RowAdam in this process, an in-process vLLM engine on
the CPU. Per step: bytes and wall time of ``export_update`` + ``push_update`` (check pass,
write, fingerprints, prefix-cache reset) against the full reload TRL does
(``model.load_weights`` of every tensor + prefix-cache reset) and against ``push_weights``
(the same load, then every tensor's fingerprint checked). Medians over the steps.

Computed (no engine): bytes per sync step on Qwen3-1.7B / 8B / 30B-A3B shapes from
``benchmarks/configs/``: the payload of an update of every projection at rank r (an FP32
d x r factor plus 96 bytes of scalars per matrix; for the MoE model each expert's gate/up/down
counted as its own matrix, an upper bound since experts without tokens in a step send
nothing) against all BF16 weights.

    .venv-vllm/bin/python benchmarks/vllm_sync.py [--steps 12]
    python benchmarks/vllm_sync.py --computed-only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import write_results

CONFIGS = Path(__file__).resolve().parent / "configs"
SCALAR_BYTES = 8 * 5 + 8 * 4 + 8 * 3  # coef, decay, seed, base, result; projection; options
SIZES = {"tiny": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, rank=8),
         "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                       num_attention_heads=8, num_key_value_heads=2, head_dim=64, rank=32)}


def computed_rows(ranks) -> list[dict]:
    rows = []
    for name in ("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b"):
        c = json.loads((CONFIGS / f"{name}.json").read_text())
        h, hd, layers = c["hidden_size"], c["head_dim"], c["num_hidden_layers"]
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        attn = [(q, h), (kv, h), (kv, h), (h, q)]  # (d, k) of q, k, v, o
        if "num_experts" in c:
            i, e = c["moe_intermediate_size"], c["num_experts"]
            mlp = [(i, h), (i, h), (h, i)] * e
            router = e * h
        else:
            i = c["intermediate_size"]
            mlp, router = [(i, h), (i, h), (h, i)], 0
        mats = (attn + mlp) * layers
        norms = layers * (2 * h + 2 * hd) + h
        embed = c["vocab_size"] * h * (1 if c["tie_word_embeddings"] else 2)
        full = 2 * (sum(d * k for d, k in mats) + norms + embed + router * layers)
        for r in ranks:
            payload = sum(4 * d * r + SCALAR_BYTES for d, _ in mats)
            rows.append({"model": name, "rank": r, "matrices": len(mats),
                         "full_bf16_bytes": full, "payload_bytes": payload,
                         "payload_over_full": payload / full})
    return rows


def measured_rows(steps: int) -> list[dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    import torch
    from safetensors.torch import save

    import rgc
    from rgc.integrations.vllm import push_update, push_weights
    from rgc.payload import payload_nbytes
    from tests.vllm_engine import load_trainer, save_base, start_engine, train_step

    rows = []
    for size, spec in SIZES.items():
        spec = dict(spec)
        rank = spec.pop("rank")
        base = save_base(Path(tempfile.mkdtemp(prefix="rgc-bench-")) / "base", torch.bfloat16,
                         **spec)
        llm = start_engine(base, torch.bfloat16)
        engine_model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.model
        model = load_trainer(base, torch.bfloat16)
        rgc.wrap(model, rank=rank, seed=0, preset="logra")
        opt = rgc.RowAdam(model.parameters(), lr=1e-3, keep_updates=True)
        push_weights(llm, model, step=0)
        times = {"payload": [], "export": [], "reload": [], "push_weights": []}
        for step in range(1, steps + 3):
            train_step(model, opt, step)
            t0 = time.perf_counter()
            payload = opt.export_update(model)
            t1 = time.perf_counter()
            sent = push_update(llm, payload)
            t2 = time.perf_counter()
            state = model.state_dict()
            engine_model.load_weights(iter(state.items()))
            llm.reset_prefix_cache()
            t3 = time.perf_counter()
            full = push_weights(llm, model, step=step)
            t4 = time.perf_counter()
            if step > 2:  # warm-up
                times["export"].append(t1 - t0)
                times["payload"].append(t2 - t0)
                times["reload"].append(t3 - t2)
                times["push_weights"].append(t4 - t3)
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"model": size, "rank": rank,
                     "params": sum(p.numel() for p in model.parameters()),
                     "payload_bytes": sent, "payload_file_bytes": len(save(payload)),
                     "full_bytes": full, "bytes_ratio": sent / full,
                     "export_s": med["export"], "export_push_update_s": med["payload"],
                     "reload_s": med["reload"], "push_weights_s": med["push_weights"],
                     "time_ratio": med["payload"] / med["reload"]})
        assert sent == payload_nbytes(payload)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--computed-only", action="store_true")
    args = parser.parse_args()
    write_results("vllm_sync_shapes", computed_rows(args.ranks),
                  title="Bytes per sync step into vLLM: payload vs full BF16 weights "
                        "(computed from configs)",
                  notes="Every projection updated at rank r; MoE experts counted one matrix "
                        "each (an upper bound). Full: every BF16 weight (embeddings, norms, "
                        "router included).")
    if args.computed_only:
        return
    write_results("vllm_sync", measured_rows(args.steps),
                  title="Sync into an in-process vLLM engine on the CPU, per step",
                  notes="Medians over the steps (after 2 warm-up steps), wall time on a shared "
                        "2-core machine (noisy). payload: export_update + push_update; reload: "
                        "vLLM load_weights of every tensor + prefix-cache reset (TRL's colocate "
                        "sync); push_weights: the same load plus the fingerprint check. "
                        "payload_bytes: what an in-process engine is handed; "
                        "payload_file_bytes: the safetensors file a multiprocess engine reads.")


if __name__ == "__main__":
    main()
