"""Bytes per rollout sync in verl: rgc's payload vs verl's ``delta_sharded`` vs full weights.

Measured on the same steps (needs verl; ``.venv-verl`` from ``scripts/setup_verl.sh``): verl's
``TrainingWorker`` with rgc's engine (``override_optimizer_config.sync: payload``) trains a
small BF16 Qwen3 (and a Qwen3-MoE) with verl's SFT loss on one CPU process; after every step
its ``get_per_tensor_param()`` is synced to a copy of the model, as verl's rollout sync would:

* ``payload``: the bytes of the step's rgc payload (what :class:`rgc.integrations.verl.sync.
  PayloadSyncMixin` sends), applied to the copy with ``rgc.apply_update`` (checked
  bit-identical to the trainer after every step);
* ``delta_sharded``: the BF16 elements whose bits the step changed, found by verl's own diff
  (``shard_delta_indices``), at its wire cost: an int32 position and the 2-byte value each;
* ``full``: every BF16 weight (verl's default sync).

Medians over the steps (the first sync, a full one, not counted).

    .venv-verl/bin/python -m benchmarks.verl_sync [--steps 6]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import write_results

SEQ, BATCH, VOCAB = 48, 8, 512


def _save_model(path: Path, moe: bool) -> None:
    # tests/ as a folder on the path: .venv-verl holds a package named tests
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from verl_models import save_model

    save_model(path, moe=moe, vocab=VOCAB, hidden=256, intermediate=768, layers=4, heads=8,
               kv_heads=4, head_dim=32, positions=128, experts=8, moe_intermediate=128)


def _batch(step: int):
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(step)
    ids = [torch.randint(3, VOCAB, (SEQ,), generator=g) for _ in range(BATCH)]
    mask = [torch.cat([torch.zeros(SEQ // 2, dtype=torch.long),
                       torch.ones(SEQ - SEQ // 2, dtype=torch.long)]) for _ in ids]
    nested = lambda ts: torch.nested.as_nested_tensor(ts, layout=torch.jagged)  # noqa: E731
    data = {"input_ids": nested(ids), "position_ids": nested([torch.arange(SEQ)] * BATCH),
            "loss_mask": nested(mask)}
    meta = {"use_remove_padding": False, "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": BATCH, "temperature": 1.0, "pad_mode": "no_padding",
            "pad_token_id": 0, "global_batch_size": BATCH, "update_lr_scheduler": True}
    return tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)


def _worker(model_dir: Path, optimizer: str, lr: float, rank: int, steps: int):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import sft_loss

    model = HFModelConfig(path=str(model_dir), external_lib="rgc.integrations.verl",
                          override_config={"attn_implementation": "eager"},
                          use_remove_padding=False)
    engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="bfloat16", seed=0,
                              use_torch_compile=False)
    optim = FSDPOptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=1.0, weight_decay=0.0,
                                total_training_steps=steps, lr_warmup_steps=0,
                                override_optimizer_config={"rank": rank, "seed": 0,
                                                           "sync": "payload"})
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=model, engine_config=engine,
        optimizer_config=optim, checkpoint_config=CheckpointConfig()))
    worker.set_loss_fn(lambda **kw: sft_loss(config=None, **kw))
    worker.reset()
    return worker


def _trainer(eng) -> dict[str, torch.Tensor]:
    return {n: t.full_tensor() if hasattr(t, "full_tensor") else t
            for n, t in eng.module.state_dict().items()}


def _measure(model_dir: Path, optimizer: str, lr: float, rank: int, steps: int) -> dict:
    from transformers import AutoModelForCausalLM
    from verl.checkpoint_engine.delta_sync.sparse_gather import shard_delta_indices

    import rgc

    worker = _worker(model_dir, optimizer, lr, rank, steps)
    eng = worker.engine
    copy = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.bfloat16)
    params = dict(copy.named_parameters())
    previous = {}
    rows = []
    for step in range(steps + 1):
        sync, _ = eng.get_per_tensor_param()
        if sync.payloads:
            for payload in sync.payloads:
                rgc.apply_update(copy, payload)
            sync.delivered()
            current = {n: t.detach().clone() for n, t in params.items()}
        else:  # the first sync: the full weights (verl's export names experts one by one)
            for _ in sync:
                pass
            for n, t in _trainer(eng).items():
                params[n].data.copy_(t)
            copy.rgc_sync_step = sync.step
            current = {n: t.detach().clone() for n, t in params.items()}
        exact = all(torch.equal(t, params[n]) for n, t in _trainer(eng).items())
        assert exact, f"the receiver differs from the trainer after sync {step}"
        if step:
            nnz = sum(shard_delta_indices(current[n].reshape(-1), previous[n].reshape(-1),
                                          0)[0].numel() for n in current)
            elements = sum(t.numel() for t in current.values())
            rows.append({"payload": sync.nbytes(), "delta": 6 * nnz,
                         "full": sum(t.numel() * t.element_size() for t in current.values()),
                         "changed": nnz / elements})
        previous = current
        if step < steps:
            worker.train_batch(_batch(step))
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_VENDOR="rgc", RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    import rgc.integrations.verl  # noqa: F401  (the CPU platform, before verl asks for one)

    torch.set_num_threads(1)
    folder = Path(tempfile.mkdtemp(prefix="rgc-verl-sync-"))
    torch.distributed.init_process_group("gloo", init_method=f"file://{folder}/store",
                                         rank=0, world_size=1)
    rows = []
    for moe in (False, True):
        model_dir = folder / ("moe" if moe else "dense")
        _save_model(model_dir, moe)
        for optimizer, lr, rank in (("RowAdam", 1e-6, 16), ("RowAdam", 1e-5, 16),
                                    ("RowAdam", 1e-4, 16), ("RowAdam", 1e-5, 64),
                                    ("RGCOptimizer", 1e-3, 16)):
            m = _measure(model_dir, optimizer, lr, rank, args.steps)
            rows.append({"model": "Qwen3-MoE" if moe else "Qwen3", "optimizer": optimizer,
                         "lr": lr, "r": rank, "payload_KB": m["payload"] / 1e3,
                         "delta_sharded_KB": m["delta"] / 1e3, "full_KB": m["full"] / 1e3,
                         "changed": m["changed"],
                         "payload_vs_delta": m["payload"] / m["delta"] if m["delta"] else
                         float("inf"),
                         "payload_vs_full": m["payload"] / m["full"]})
            print(rows[-1], flush=True)
    torch.distributed.destroy_process_group()
    write_results("verl_sync", rows, title="Bytes per rollout sync in verl (CPU, one process)",
                  notes=(f"Per sync step, median over {args.steps} steps of verl's SFT loss on "
                         f"{BATCH} random sequences of {SEQ} tokens: rgc's payload, verl's "
                         "delta_sharded (the BF16 elements whose bits changed, by verl's own "
                         "diff; int32 position + BF16 value each), and all BF16 weights. "
                         "`changed`: the fraction of elements changed. Qwen3: 4 layers, "
                         "hidden 256, MLP 768, vocabulary 512; Qwen3-MoE: 8 experts of 128, 2 "
                         "per token. The receiver was bit-identical to the trainer after every "
                         "sync. `lr` of RGCOptimizer is its relative step tau."))


if __name__ == "__main__":
    main()
