"""Sync into a vLLM engine per training step: rgc payload vs full-weight reload.

Measured (needs vLLM; ``.venv-vllm`` from ``scripts/setup_vllm.sh``): a tiny and a small
Qwen3 and Qwen3-MoE (BF16, r=8 and r=32) trained with RowAdam in this process, an in-process
vLLM engine on the CPU. Per step: wall time of ``export_update`` and of ``push_update``
(check, write, fingerprints, prefix-cache reset) against the full reload TRL does
(``model.load_weights`` of every tensor + prefix-cache reset; the engine's experts, which
vLLM's CPU kernels store prepacked, unpacked around it and packed again as ``push_weights``
does) and against ``push_weights``
(the same load, then every tensor's fingerprint checked); medians over the steps. Bytes, on
the same steps: the payload, all BF16 weights, and a sparse delta of the BF16 elements the
step changed (bit pattern differs), sent as an int32 flat index within its tensor + the
2-byte value (6 bytes per changed element; 10 with int64 indices), with the fraction of
elements changed.

Computed (no engine): bytes per sync step on Qwen3-1.7B / 8B / 30B-A3B / 235B-A22B shapes from
``benchmarks/configs/``: the payload of an update of every projection at rank r (an FP32
d x r factor plus 96 bytes of scalars per matrix; for an MoE model each expert's gate/up/down
counted as its own matrix, an upper bound since experts without tokens in a step send
nothing) against all BF16 weights, and the fraction of elements changed below which a sparse
delta (int32 index + BF16 value) would be smaller than the payload.

    .venv-vllm/bin/python -m benchmarks.vllm_sync [--steps 12]
    python -m benchmarks.vllm_sync --computed-only
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
DELTA_BYTES = {"int32": 4 + 2, "int64": 8 + 2}  # index + BF16 value per changed element
_ATTN = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=64)
#: name: (MoE, checkpoint overrides, rank)
SIZES = {"tiny": (False, dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2), 8),
         "small": (False, dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6,
                               **_ATTN), 32),
         "tiny-moe": (True, dict(), 8),
         "small-moe": (True, dict(hidden_size=512, moe_intermediate_size=256, num_experts=16,
                                  num_experts_per_tok=4, num_hidden_layers=4, **_ATTN), 32)}
LRS = (1e-3, 1e-5)


def computed_rows(ranks) -> list[dict]:
    rows = []
    for name in ("qwen3-1.7b", "qwen3-8b", "qwen3-30b-a3b", "qwen3-235b-a22b"):
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
                         "payload_over_full": payload / full,
                         "delta_parity_fraction": payload / (full // 2 * DELTA_BYTES["int32"])})
    return rows


def _changed(before: dict, model) -> tuple[int, int]:
    """``(elements whose bits changed since before, elements)`` over the model's tensors."""
    import torch

    changed = total = 0
    for name, t in model.state_dict().items():
        a, b = before[name], t.detach()
        if a.dtype == torch.bfloat16:
            a, b = a.view(torch.int16), b.view(torch.int16)
        changed += int((a != b).sum())
        total += t.numel()
    return changed, total


def measure(size: str, lr: float, steps: int) -> dict:
    """One measured row: a model of ``SIZES[size]`` trained at ``lr``, ``steps`` steps after
    2 warm-up steps."""
    import torch
    from safetensors.torch import save

    import rgc
    from rgc.integrations.vllm import RGCWorkerExtension, push_update, push_weights
    from rgc.payload import payload_nbytes
    from tests import vllm_engine as ve

    moe, overrides, rank = SIZES[size]
    folder = Path(tempfile.mkdtemp(prefix="rgc-bench-")) / "base"
    base = (ve.save_moe_base if moe else ve.save_base)(folder, torch.bfloat16, **overrides)
    llm = ve.start_engine(base, torch.bfloat16)
    receiver = RGCWorkerExtension.rgc_receiver(llm.llm_engine.model_executor.driver_worker.worker)
    model = (ve.load_moe_trainer if moe else ve.load_trainer)(base, torch.bfloat16)
    rgc.wrap(model, rank=rank, seed=0, preset="logra")
    opt = rgc.RowAdam(model.parameters(), lr=lr, keep_updates=True)
    push_weights(llm, model, step=0)
    times = {"export": [], "push_update": [], "reload": [], "push_weights": []}
    changed, sizes = [], []
    for step in range(1, steps + 3):
        before = {n: t.detach().clone() for n, t in model.state_dict().items()}
        ve.train_step(model, opt, step)
        t0 = time.perf_counter()
        payload = opt.export_update(model)
        t1 = time.perf_counter()
        sent = push_update(llm, payload)
        t2 = time.perf_counter()
        receiver.load(model.state_dict(), step)  # load_weights (+ unpack/pack of experts)
        llm.reset_prefix_cache()
        t3 = time.perf_counter()
        full = push_weights(llm, model, step=step)
        t4 = time.perf_counter()
        assert sent == payload_nbytes(payload)
        sizes.append((sent, len(save(payload)), full))
        changed.append(_changed(before, model))
        if step > 2:  # warm-up
            for key, t in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[key].append(t)
    med = {k: statistics.median(v) for k, v in times.items()}
    sent, file_bytes, full = sizes[-1]
    n_changed, elements = (statistics.median(c[i] for c in changed[2:]) for i in (0, 1))
    delta = n_changed * DELTA_BYTES["int32"]
    return {"model": size, "lr": lr, "rank": rank,
            "params": sum(p.numel() for p in model.parameters()),
            "payload_bytes": sent, "payload_file_bytes": file_bytes, "full_bytes": full,
            "changed_fraction": n_changed / elements, "delta_int32_bytes": delta,
            "delta_int64_bytes": n_changed * DELTA_BYTES["int64"],
            "payload_over_full": sent / full, "payload_over_delta": sent / delta,
            "export_s": med["export"], "push_update_s": med["push_update"],
            "reload_s": med["reload"], "push_weights_s": med["push_weights"],
            "time_ratio": (med["export"] + med["push_update"]) / med["reload"]}


def measured_rows(steps: int, sizes, lrs) -> list[dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    return [measure(size, lr, steps) for size in sizes for lr in lrs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--computed-only", action="store_true")
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--lrs", type=float, nargs="+", default=list(LRS))
    parser.add_argument("--name", default="vllm_sync", help="results file name")
    args = parser.parse_args()
    write_results("vllm_sync_shapes", computed_rows(args.ranks),
                  title="Bytes per sync step into vLLM: payload vs full BF16 weights "
                        "(computed from configs)",
                  notes="Every projection updated at rank r; MoE experts counted one matrix "
                        "each (an upper bound). Full: every BF16 weight (embeddings, norms, "
                        "router included). delta_parity_fraction: the fraction of BF16 "
                        "elements changed per step at which a sparse delta (int32 index + "
                        "BF16 value, 6 bytes each) is as large as the payload.")
    if args.computed_only:
        return
    write_results(args.name, measured_rows(args.steps, args.sizes, args.lrs),
                  title="Sync into an in-process vLLM engine on the CPU, per step",
                  notes="Medians over the steps (after 2 warm-up steps), wall time on a shared "
                        "2-core machine (noisy). time_ratio: (export_update + push_update) / "
                        "reload; reload: vLLM load_weights of every tensor + prefix-cache reset "
                        "(TRL's colocate sync); push_weights: the same load plus the "
                        "fingerprint check. payload_bytes: what an in-process engine is "
                        "handed; payload_file_bytes: the safetensors file a multiprocess engine "
                        "reads. changed_fraction: BF16 elements whose bits the step changed; "
                        "delta_int32/int64_bytes: those elements sent as an int32/int64 flat "
                        "index + the BF16 value (median over the steps).")


if __name__ == "__main__":
    main()
