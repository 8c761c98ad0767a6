"""The large-model recipe end to end: meta-device init, FSDP2, a mixture of experts, and
sketch-sized policy sync.

    torchrun --nproc-per-node 2 examples/large_model.py            # a Qwen3-MoE
    torchrun --nproc-per-node 2 examples/large_model.py --dense    # a dense Qwen3

1. The model is built on the meta device (nothing allocated) from its config and wrapped with
   rgc there; ``fully_shard`` shards each decoder layer and the model (an expert stack is
   sharded over its experts, a 2-D weight over its rows).
2. ``to_empty`` materialises the shards (rgc makes every projection from its seed here),
   transformers' ``init_weights`` makes the buffers no checkpoint holds (rotary frequencies),
   and ``set_model_state_dict`` loads the pretrained weights broadcast from rank 0. (A real
   run would load a checkpoint; here rank 0 makes one from a seed.)
3. ``DistributedRGCOptimizer`` trains it on each rank's share of the batch, and after every
   step ``export_update`` builds the step's payload (factors of d x r per weight, E x d x r
   per expert stack), which rank 0 applies to a replica of the policy standing in for an
   inference engine (``rgc.integrations.vllm`` applies the same payload to a running vLLM
   engine: docs/vllm.md). The replica ends bit-identical to the trained weights.

Runs on CPUs (gloo) and GPUs (nccl, one process per GPU); the config is tiny so that it does.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import transformers as tf
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    set_model_state_dict,
)
from torch.distributed.fsdp import fully_shard

import rgc


def config(dense: bool) -> tf.PretrainedConfig:
    common = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                  tie_word_embeddings=False)
    if dense:
        return tf.Qwen3Config(**common, intermediate_size=128)
    return tf.Qwen3MoeConfig(**common, intermediate_size=128, moe_intermediate_size=32,
                             num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)


def batch(step: int, size: int) -> torch.Tensor:
    """The step's global batch (the same on every rank): sequences of a simple rule."""
    gen = torch.Generator().manual_seed(step)
    start = torch.randint(0, 64, (size, 1), generator=gen)
    return (start + 3 * torch.arange(16)) % 64


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dense", action="store_true", help="a dense Qwen3 instead of MoE")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    parser.add_argument("--rank", type=int, default=8, help="sketch rank r")
    args = parser.parse_args()

    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda" if use_cuda else "cpu")
    cfg = config(args.dense)

    # the pretrained weights: a checkpoint in a real run, here made by rank 0 from a seed;
    # rank 0 also holds the policy replica that receives the payloads (an engine's weights)
    pretrained, replica = {}, None
    if rank == 0:
        torch.manual_seed(0)
        replica = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).to(device)
        pretrained = {k: v.clone() for k, v in replica.state_dict().items()}

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    rgc.wrap(model, args.rank, seed=0)  # on meta: nothing allocated; same seed on every rank
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    model.to_empty(device=device)  # the projections are made here, from their seeds
    model.init_weights()  # the rotary buffers (no checkpoint holds them)
    set_model_state_dict(model, pretrained, options=StateDictOptions(  # consumes pretrained
        full_state_dict=True, broadcast_from_rank0=True))
    model.train()

    lr = 1e-2  # RGC's step relative to ||W|| (rgc.calibrate_lr gives one from AdamW's lr)
    opt = rgc.DistributedRGCOptimizer(model.parameters(), lr=lr, seed=0, keep_updates=True)
    share = args.batch // world
    for step in range(args.steps):
        ids = batch(step, args.batch)[rank * share:(rank + 1) * share].to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        payload = opt.export_update(model)  # collective: every rank calls it
        sent = sum(t.numel() * t.element_size() for t in payload.values())
        if replica is not None:
            rgc.apply_update(replica, payload)  # checks fingerprints before and after
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        if rank == 0:
            print(f"step {step:2d}  loss {float(mean) / world:.4f}  payload {sent} B  "
                  f"sketches sent {opt.last_comm_bytes} B/rank", flush=True)

    trained = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                    cpu_offload=True))
    if rank == 0:
        weights = sum(t.numel() * t.element_size() for t in trained.values())
        same = all(torch.equal(v.cpu(), trained[k]) for k, v in replica.state_dict().items())
        print(f"full weights {weights} B; replica bit-identical to the trained policy: {same}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
