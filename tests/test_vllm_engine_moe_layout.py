"""Expert stacks in vLLM's fused-MoE layer under tensor and expert parallelism, without an
engine (skipped without vLLM).

The engine tests (``test_vllm_engine_moe.py``) serve the experts from one rank; the layouts
of other ranks are checked here against vLLM's own weight loader. A ``RoutedExperts`` layer
is made for each rank of a tensor-parallel (2 ranks: each holds rows of gate and up and
columns of down of every expert) or expert-parallel (2 ranks, linear and round-robin
placement: each holds whole experts) engine, its intermediate size padded as backends pad it,
stored plain or in the CPU kernels' prepacked order (padded to a multiple of 32 first, as
they do), and filled by ``RoutedExperts.load_weights`` from the trainer's fused
``gate_up_proj``/``down_proj``:

* each block :func:`rgc.integrations.vllm.layout.locate_experts` finds holds the trainer
  elements it names, and the blocks of all ranks cover every element exactly once;
* one payload applied by each rank's receiver on its blocks (check pass, then write) gives,
  put together, the trainer's updated experts bit for bit, and the ranks' fingerprint shares
  add up to the payload's ``base`` and ``result``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import tests.vllm_engine  # noqa: F401  (before vLLM: its logging set-up)

pytest.importorskip("vllm")

import rgc  # noqa: E402
from rgc.integrations.vllm.client import _combined  # noqa: E402
from rgc.integrations.vllm.layout import locate_experts  # noqa: E402
from rgc.integrations.vllm.receiver import Receiver  # noqa: E402
from rgc.payload import decode, payload_checksum  # noqa: E402
from tests.models import tiny_moe  # noqa: E402

E, HIDDEN, INTER = 4, 32, 16
PATH = "model.layers.0.mlp.experts"
#: (tensor-parallel size, expert-parallel size, placement, padded intermediate size per rank
#: of a plain layout; the CPU kernels pad it to a multiple of 32 before they prepack)
LAYOUTS = [(1, 1, "linear", None), (2, 1, "linear", None), (2, 1, "linear", 12),
           (1, 2, "linear", None), (1, 2, "round_robin", 20)]


def routed_layer(rank, tp, ep, placement, padded, dtype, packing):
    """A ``RoutedExperts`` of rank ``rank`` with empty ``w13``/``w2`` and vLLM's weight
    loader (the attributes its loader and rgc's layout read; no engine, no process group)."""
    from vllm.model_executor.layers.fused_moe.config import FusedMoEParallelConfig
    from vllm.model_executor.layers.fused_moe.expert_map_manager import ExpertMapManager
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend
    from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    parallel = FusedMoEParallelConfig(
        tp_size=tp, pcp_size=1, dp_size=1, ep_size=ep, tp_rank=rank if tp > 1 else 0,
        pcp_rank=0, dp_rank=0, ep_rank=rank if ep > 1 else 0, sp_size=1, use_ep=ep > 1,
        all2all_backend="allgather_reducescatter", enable_eplb=False)
    manager = ExpertMapManager(max_num_batched_tokens=16, top_k=2, global_num_experts=E,
                               num_redundant_experts=0, num_expert_group=None,
                               moe_parallel_config=parallel, placement_strategy=placement,
                               enable_eplb=False)
    layer = RoutedExperts.__new__(RoutedExperts)
    nn.Module.__init__(layer)
    layer.layer_name = PATH
    layer.moe_config = SimpleNamespace(
        moe_parallel_config=parallel, tp_rank=parallel.tp_rank, is_act_and_mul=True,
        num_experts=E, num_logical_experts=E, hidden_dim_unpadded=HIDDEN,
        intermediate_size=INTER, tp_shard_with_padding=False)
    layer.expert_map_manager = manager
    layer.quant_config = None
    layer._fused_shared_expert_quantizer = None
    layer._loaded_expert_biases = set()
    layer.ckpt_gate_proj_name, layer.ckpt_down_proj_name = "gate_proj", "down_proj"
    layer.ckpt_up_proj_name = "up_proj"
    layer.is_fused_checkpoint_transposed = False
    layer.lora_base_layer_prefix = ""
    method = UnquantizedFusedMoEMethod.__new__(UnquantizedFusedMoEMethod)
    nn.Module.__init__(method)
    method.unquantized_backend = (UnquantizedMoeBackend.CPU if packing
                                  else UnquantizedMoeBackend.TRITON)
    method.moe_kernel = SimpleNamespace(fused_experts=SimpleNamespace(isa="vec"))
    layer.quant_method = method
    inter = padded or INTER // tp
    local = manager.local_num_experts
    for name, shape in (("w13_weight", (local, 2 * inter, HIDDEN)),
                        ("w2_weight", (local, HIDDEN, inter))):
        param = nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
        param.weight_loader = layer.weight_loader
        layer.register_parameter(name, param)
    return layer


def engine_ranks(layout, weights, dtype, packing):
    """The ranks' ``(model, layer)``, each layer filled by vLLM's loader from ``weights``
    (``{"gate_up_proj": ..., "down_proj": ...}``), then prepacked as the CPU kernels do."""
    tp, ep, placement, padded = layout
    if packing:
        padded = -(-INTER // tp // 32) * 32
    ranks = []
    for rank in range(tp * ep):
        layer = routed_layer(rank, tp, ep, placement, padded, dtype, packing)
        with torch.no_grad():
            list(layer.load_weights(list(weights.items())))
            if packing:
                from vllm._custom_ops import cpu_prepack_moe_weight

                for name in ("w13_weight", "w2_weight"):
                    param = getattr(layer, name)
                    param.data = cpu_prepack_moe_weight(param.data, "vec")
        root = nn.Module()
        root.model = nn.Module()
        root.model.layers = nn.ModuleList([nn.Module()])
        root.model.layers[0].mlp = nn.Module()
        root.model.layers[0].mlp.experts = layer
        ranks.append((root, layer))
    return ranks


@pytest.mark.parametrize("packing", [False, True], ids=["plain", "prepacked"])
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "tp{}-ep{}-{}-pad{}".format(*x))
def test_blocks_hold_what_the_engines_loader_put_there(layout, packing):
    shapes = {"gate_up_proj": (E, 2 * INTER, HIDDEN), "down_proj": (E, HIDDEN, INTER)}
    codes = {a: torch.arange(1, 1 + E * s[1] * s[2], dtype=torch.float32).view(s)
             for a, s in shapes.items()}
    covered = {a: torch.zeros(E * s[1], s[2], dtype=torch.int64) for a, s in shapes.items()}
    for root, layer in engine_ranks(layout, codes, torch.float32, packing):
        params = dict(root.named_parameters())
        for attr in shapes:
            pieces = locate_experts(layer, attr, f"{PATH}")
            assert (pieces.packing is not None) == packing
            held = 0
            for block in pieces.blocks:
                row0, rows, col0, cols = pieces.key(block)
                want = codes[attr].view(-1, pieces.k)[row0:row0 + rows, col0:col0 + cols]
                assert torch.equal(pieces.get(params, block), want), (attr, block)
                covered[attr][row0:row0 + rows, col0:col0 + cols] += 1
                held += rows * cols
            # nothing else was loaded into this rank's parameter (the padding stays zero)
            assert int((params[pieces.param] != 0).sum()) == held
    for attr, count in covered.items():
        assert bool((count == 1).all()), f"{attr}: blocks overlap or leave gaps"


def _trained_payload(dtype, opt_name):
    model = tiny_moe("qwen3_moe", dtype, seed=1, hidden=HIDDEN, experts=E,
                     expert_inter=INTER, layers=1)
    rgc.wrap(model, rank=4, seed=2)
    opt = (rgc.RGCOptimizer(model.parameters(), lr=5e-2, chunk_rows=5, keep_updates=True)
           if opt_name == "rgc" else
           rgc.RowAdam(model.parameters(), lr=2e-2, weight_decay=0.1, chunk_rows=5,
                       keep_updates=True))
    experts = model.model.layers[0].mlp.experts
    before = {a: getattr(experts, a).detach().clone() for a in ("gate_up_proj", "down_proj")}
    ids = torch.randint(1, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    model(ids, labels=ids).loss.backward()
    opt.step()
    after = {a: getattr(experts, a).detach().clone() for a in before}
    full = opt.export_update(model)
    payload = {k: v for k, v in full.items() if k.startswith(f"{PATH}.") or k.startswith("rgc/")}
    payload["rgc/checksum"] = payload_checksum(payload)
    return before, after, payload


@pytest.mark.parametrize("opt_name", ["rgc", "rowadam"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("layout", LAYOUTS[1:], ids=lambda x: "tp{}-ep{}-{}-pad{}".format(*x))
def test_ranks_updated_apart_equal_the_trainers_experts(layout, dtype, opt_name):
    before, after, payload = _trained_payload(dtype, opt_name)
    entries = {e.name.rpartition(".")[2]: e for e in decode(payload).entries}
    assert all(e.stack is not None and e.stack.count == E for e in entries.values())
    ranks = engine_ranks(layout, before, dtype, packing=True)
    receivers = [Receiver(root) for root, _ in ranks]
    replies = [r.prepare(payload) for r in receivers]
    dims = {e.name: (E * e.d, e.k) for e in entries.values()}
    assert _combined(replies, 1, dims) == {e.name: e.base for e in entries.values()}
    assert _combined(replies, 2, dims) == {e.name: e.result for e in entries.values()}
    written = [r.commit(replies[0]["step"]) for r in receivers]
    assert _combined(written, 1, dims) == {e.name: e.result for e in entries.values()}
    for attr, entry in entries.items():
        out = torch.full((E * entry.d, entry.k), float("nan"), dtype=dtype)
        for receiver in receivers:
            for (row0, rows, col0, cols, _, _), block in receiver.read([entry.name])[entry.name]:
                out[row0:row0 + rows, col0:col0 + cols] = block
        assert torch.equal(out.view(after[attr].shape), after[attr]), attr
