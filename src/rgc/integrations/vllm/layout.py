"""Where each trainer tensor lives inside a vLLM model, and fingerprints of the parts.

A trainer parameter (a Hugging Face name such as ``model.layers.0.self_attn.q_proj.weight``)
is held by the engine as a :class:`Piece`: a block of rows and columns of one engine
parameter. vLLM fuses and shards its linear layers:

* ``q_proj``/``k_proj``/``v_proj`` are row slices of ``qkv_proj``, ``gate_proj``/``up_proj``
  of ``gate_up_proj`` (the model's ``packed_modules_mapping`` names them);
* under tensor parallelism a column-parallel layer keeps rows ``[rank*n, (rank+1)*n)`` of the
  trainer's matrix (k/v heads replicated over ``num_kv_head_replicas`` ranks), a row-parallel
  layer (``o_proj``, ``down_proj``) keeps columns ``[rank*m, (rank+1)*m)``, a vocab-parallel
  embedding keeps the vocabulary rows of its shard (the padding rows belong to no trainer
  tensor); anything else (norms) is whole on every rank.

Element ``(i, j)`` of a piece is element ``(row0 + i, col0 + j)`` of the trainer's ``d x k``
matrix (1-D tensors are ``d x 1``), whose flat index ``(row0 + i) * k + col0 + j`` keys both
its stochastic-rounding bits and its term in :func:`rgc.payload.fingerprint`. The fingerprint is
a sum over elements modulo a prime, so the partial sums of the pieces (one copy of each
replicated piece) add up to the fingerprint of the whole tensor: :func:`piece_fingerprint`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from rgc.payload import FINGERPRINT_MODULUS, fingerprint_share


@dataclass(frozen=True)
class Piece:
    """Rows ``[row0, row0 + rows)`` x columns ``[col0, col0 + cols)`` of a trainer tensor of
    ``shape`` (2-D view ``d x k``), held at rows ``[local_row0, local_row0 + rows)`` of the
    engine parameter ``param`` viewed as ``(-1, cols)``."""

    param: str
    local_row0: int
    row0: int
    rows: int
    col0: int
    cols: int
    d: int
    k: int

    @property
    def key(self) -> tuple[int, int, int, int]:
        """The block of the trainer tensor this piece holds (equal for replicated copies)."""
        return self.row0, self.rows, self.col0, self.cols

    def view(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        """The piece as a ``rows x cols`` view of the engine's parameter (shares storage)."""
        return params[self.param].view(-1, self.cols)[self.local_row0:self.local_row0 + self.rows]


def _matrix_shape(shape) -> tuple[int, int]:
    """``(d, k)``: rows are the first dimension, a 1-D tensor is one column."""
    shape = tuple(shape)
    return (shape[0], math.prod(shape[1:])) if len(shape) > 1 else (shape[0], 1)


_QKV_SHARDS = {"q": 0, "k": 1, "v": 2}


def _resolve(model: nn.Module, name: str) -> tuple[nn.Module, str, int | None, str]:
    """``(module, attribute, index among the fused sub-layers or None, engine name)``.

    Names go through the model's ``hf_to_vllm_mapper`` (whose stacked entries name the fused
    layer and the shard, as vLLM's weight loader reads them), then its
    ``packed_modules_mapping``.
    """
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped, shard = name, None
    if mapper is not None:
        result = mapper._map_name_with_shard(name)
        if result is None:
            raise KeyError(f"the engine's model drops {name!r} when it loads weights")
        mapped, shard = result
    if isinstance(shard, list):
        raise KeyError(f"{name!r} is loaded into several shards {shard}; rgc cannot update it")
    index = _QKV_SHARDS.get(shard, shard)
    path, _, attr = mapped.rpartition(".")
    try:
        module = model.get_submodule(path)
        if isinstance(getattr(module, attr, None), torch.Tensor):
            return module, attr, index, mapped
    except AttributeError:
        pass
    parent, _, leaf = path.rpartition(".")
    for fused, parts in getattr(model, "packed_modules_mapping", {}).items():
        if leaf in parts:
            fused_path = f"{parent}.{fused}" if parent else fused
            try:
                module = model.get_submodule(fused_path)
            except AttributeError:
                continue
            if isinstance(getattr(module, attr, None), torch.Tensor):
                return module, attr, parts.index(leaf), f"{fused_path}.{attr}"
    raise KeyError(f"the engine's model has no parameter for {name!r} (looked for {mapped!r} "
                   "and its fused layer)")


def _fused_rows(module: nn.Module, index: int) -> tuple[int, int, int, int]:
    """``(local row offset, rows on this rank, first trainer row, trainer rows)`` of sub-layer
    ``index`` of a fused column-parallel layer (vLLM's weight loader places them so)."""
    from vllm.model_executor.layers.linear import QKVParallelLinear

    if isinstance(module, QKVParallelLinear):
        h, hv = module.head_size, module.v_head_size
        sizes = [module.num_heads * h, module.num_kv_heads * h, module.num_kv_heads * hv]
        totals = [module.total_num_heads * h, module.total_num_kv_heads * h,
                  module.total_num_kv_heads * hv]
        shard = module.tp_rank if index == 0 else module.tp_rank // module.num_kv_head_replicas
    else:  # MergedColumnParallelLinear
        totals = list(module.output_sizes)
        sizes = [t // module.tp_size for t in totals]
        shard = module.tp_rank
    return sum(sizes[:index]), sizes[index], shard * sizes[index], totals[index]


def locate(model: nn.Module, name: str) -> Piece:
    """The :class:`Piece` of trainer tensor ``name`` on this rank of the engine's ``model``.

    Raises ``KeyError`` for a name the engine has no parameter for.
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    module, attr, index, engine_name = _resolve(model, name)
    param = getattr(module, attr)
    local_rows, cols = _matrix_shape(param.shape) if param.numel() else (0, 0)
    local_row0, row0, rows, d = 0, 0, local_rows, local_rows
    col0, k = 0, cols
    if index is not None:
        if not isinstance(module, (QKVParallelLinear, MergedColumnParallelLinear)):
            raise KeyError(f"{name!r} maps into {engine_name!r}, a fused layer of a kind rgc "
                           f"does not know ({type(module).__name__})")
        local_row0, rows, row0, d = _fused_rows(module, index)
    elif isinstance(module, VocabParallelEmbedding) and attr == "weight":
        idx = module.shard_indices
        rows, row0, d = idx.num_org_elements, idx.org_vocab_start_index, module.org_vocab_size
    elif isinstance(module, ColumnParallelLinear) and getattr(param, "output_dim", None) == 0:
        row0, d = module.tp_rank * rows, rows * module.tp_size
    if isinstance(module, RowParallelLinear) and getattr(param, "input_dim", None) == 1:
        col0, k = module.tp_rank * cols, cols * module.tp_size
    return Piece(engine_name, local_row0, row0, rows, col0, cols, d, k)


@torch.no_grad()
def piece_fingerprint(values: torch.Tensor, row0: int, col0: int, k: int) -> int:
    """This block's share of :func:`rgc.payload.fingerprint` of the whole ``d x k`` tensor.

    ``values`` (BF16 or FP32, ``rows x cols``) is the block at row ``row0``, column ``col0``.
    The shares of disjoint blocks covering the tensor add up (mod ``2^31 - 1``) to its
    fingerprint.
    """
    return int(fingerprint_share(values, row0, col0, k))


def combine(shares: list[tuple[tuple, int]], d: int, k: int, name: str) -> int:
    """The fingerprint of a whole tensor from ``[(piece key, share), ...]`` of all ranks.

    Replicated pieces (same key) must agree; the distinct pieces must cover ``d x k`` exactly.
    Raises ``RuntimeError`` otherwise.
    """
    by_key: dict[tuple, int] = {}
    for key, share in shares:
        if by_key.setdefault(tuple(key), share) != share:
            raise RuntimeError(f"the engine's ranks hold different values of the replicated "
                               f"{name!r} block {tuple(key)}; resend the weights with "
                               "push_weights")
    covered = sum(rows * cols for _, rows, _, cols in by_key)
    if covered != d * k:
        raise RuntimeError(f"the engine's ranks hold {covered} of the {d * k} elements of "
                           f"{name!r}; rgc does not know this engine layout")
    return sum(by_key.values()) % FINGERPRINT_MODULUS
