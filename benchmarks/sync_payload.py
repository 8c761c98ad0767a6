"""Policy-sync payload size per layer shape: the sketch-sized update vs the full BF16 weight.

For each projection shape of Qwen3-1.7B and Qwen3-8B and each rank, one real update is made
(RowAdam on a BF16 CompressedLinear with a random sketch), exported, serialised with
safetensors, and the bytes counted; a receiver applies it and is checked bit-identical.
Expected ratio payload / weight ~ (4 d r) / (2 d k) = 2 r / k.

    PYTHONPATH=src python benchmarks/sync_payload.py [--ranks 64 128 256] [--models 1.7B 8B]
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn as nn
from safetensors.torch import save

import rgc
from benchmarks.common import write_results

# (hidden, intermediate, q heads, kv heads, head_dim, layers)
MODELS = {"1.7B": (2048, 6144, 16, 8, 128, 28), "8B": (4096, 12288, 32, 8, 128, 36)}


def layer_shapes(hidden, inter, heads, kv_heads, head_dim):
    """(name, d = out_features, k = in_features) of one decoder layer's projections."""
    return [("q_proj", heads * head_dim, hidden), ("k_proj", kv_heads * head_dim, hidden),
            ("v_proj", kv_heads * head_dim, hidden), ("o_proj", hidden, heads * head_dim),
            ("gate_proj", inter, hidden), ("up_proj", inter, hidden), ("down_proj", hidden, inter)]


def measure(d: int, k: int, rank: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(k, d, bias=False, dtype=torch.bfloat16))
    receiver = copy.deepcopy(model)
    rgc.wrap(model, rank, targets=["0"], preset="logra")
    opt = rgc.RowAdam(model.parameters(), lr=1e-4, keep_updates=True)
    model[0].sketch = torch.randn(d, rank)
    opt.step()
    payload = opt.export_update(model)
    wire = save(payload)
    rgc.apply_update(receiver, payload)
    assert torch.equal(receiver[0].weight, model[0].weight)
    weight_bytes = 2 * d * k
    return {"d": d, "k": k, "rank": rank, "bf16_weight_bytes": weight_bytes,
            "factor_bytes": 4 * d * rank, "payload_bytes": len(wire),
            "ratio": len(wire) / weight_bytes, "expected_2r_over_k": 2 * rank / k}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    args = parser.parse_args()
    rows, cache = [], {}
    for name in args.models:
        *dims, n_layers = MODELS[name]
        shapes = layer_shapes(*dims)
        for rank in args.ranks:
            total_weight = total_payload = 0
            for proj, d, k in shapes:
                if (d, k, rank) not in cache:
                    cache[d, k, rank] = measure(d, k, rank)
                row = {"model": f"Qwen3-{name}", "layer": proj, **cache[d, k, rank]}
                rows.append(row)
                total_weight += row["bf16_weight_bytes"] * n_layers
                total_payload += row["payload_bytes"] * n_layers
            rows.append({"model": f"Qwen3-{name}", "layer": f"all {7 * n_layers} projections",
                         "d": "", "k": "", "rank": rank, "bf16_weight_bytes": total_weight,
                         "factor_bytes": "", "payload_bytes": total_payload,
                         "ratio": total_payload / total_weight, "expected_2r_over_k": ""})
    notes = ("payload_bytes: the safetensors file of one layer's update (FP32 d x r factor, "
             "coefficient, seeds, projection spec, base and result fingerprints, SHA-256 "
             "checksum, JSON header). Totals are per-layer payloads times the number of decoder "
             "layers (embeddings, norms and the LM head are not trained here). Every receiver "
             "(a plain BF16 copy given the payload through rgc.apply_update) was checked "
             "bit-identical with the trainer.")
    write_results("sync_payload", rows, title="Policy-sync payload vs full BF16 weights",
                  notes=notes)


if __name__ == "__main__":
    main()
