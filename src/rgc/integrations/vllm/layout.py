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

A stack of experts (a transformers Experts module's 3-D ``gate_up_proj`` ``[E, 2I, H]``,
``up_proj`` ``[E, I, H]`` without a gate, ``down_proj`` ``[E, H, I]``) is held by vLLM's
fused-MoE layer (``RoutedExperts``) as ``w13_weight`` ``[E_local, 2 I_p, H]`` and
``w2_weight`` ``[E_local, H, I_p]``: :class:`ExpertPieces`, one :class:`ExpertBlock` per
expert and part on this rank, as the layer's weight loader places them:

* expert parallelism: trainer expert ``e`` is local expert ``expert_map[e]`` of this rank (or
  not here);
* ``gate`` is rows ``[0, I_r)`` of ``w13``, ``up`` rows ``[h, h + I_r)`` with ``h`` half of
  ``w13``'s rows (``I_p >= I_r``: the backend may pad the intermediate size with zero rows
  and columns);
* tensor parallelism: rank ``t`` holds the trainer's gate and up rows ``[t I_r, (t+1) I_r)``
  and ``down``'s columns ``[t I_r, (t+1) I_r)``, ``I_r = I / tp``;
* a backend that keeps each expert's matrix in its own order (vLLM's CPU kernels prepack
  ``w13``/``w2`` for their grouped GEMM) is read and written through that order:
  :class:`Packing`, found by running the backend's own packing on index-coded matrices.

Element ``(i, j)`` of expert ``e`` is element ``(e d + i, j)`` of the trainer's ``[E d, k]``
matrix, whose flat index keys its rounding bits and its fingerprint term, as above.
"""

from __future__ import annotations

import math
from collections.abc import Callable
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


def locate(model: nn.Module, name: str) -> Piece | ExpertPieces:
    """The :class:`Piece` of trainer tensor ``name`` on this rank of the engine's ``model``,
    or the :class:`ExpertPieces` of a stack of experts the engine holds in a fused-MoE layer.

    Raises ``KeyError`` for a name the engine has no parameter for, or holds in a layout rgc
    does not write.
    """
    from vllm.model_executor.layers.linear import (
        ColumnParallelLinear,
        MergedColumnParallelLinear,
        QKVParallelLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    stack = _locate_stack(model, name)
    if stack is not None:
        return stack
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


# -- stacks of experts ------------------------------------------------------------------------

@dataclass(frozen=True)
class ExpertBlock:
    """Rows ``[row0, row0 + rows)`` x columns ``[col0, col0 + cols)`` of trainer expert
    ``expert``'s ``d x k`` matrix, held at rows ``[local_row0, local_row0 + rows)`` x columns
    ``[local_col0, local_col0 + cols)`` of local expert ``slot`` of the engine parameter (each
    local expert's matrix read in the engine's plain ``[D, K]`` order)."""

    expert: int
    slot: int
    local_row0: int
    local_col0: int
    row0: int
    rows: int
    col0: int
    cols: int


class Packing:
    """The order in which a backend stores each ``[D, K]`` expert matrix of a ``[E, D, K]``
    parameter: ``pack`` maps a plain ``[E, D, K]`` tensor to the stored one (same shape and
    dtype, each expert's elements permuted in the same way, bits moved as they are).

    :meth:`positions` finds where each plain element is stored by packing index-coded
    matrices (16 bits at a time for BF16); it is computed once per shape and dtype.
    """

    def __init__(self, pack: Callable[[torch.Tensor], torch.Tensor], name: str):
        self.pack = pack
        self.name = name
        self._positions: dict[tuple, torch.Tensor] = {}
        self._plain_index: dict[tuple, torch.Tensor] = {}

    def __repr__(self) -> str:
        return f"Packing({self.name!r})"

    @torch.no_grad()
    def positions(self, weight: torch.Tensor) -> torch.Tensor:
        """int64 ``[D, K]`` on ``weight``'s device: the flat index, within one stored expert
        matrix, of each plain element. Raises ``KeyError`` if the packing is not a
        permutation of each expert's elements."""
        d, k = weight.shape[-2:]
        key = (d, k, weight.dtype, weight.device)
        if key not in self._positions:
            n = d * k
            index = torch.arange(n, dtype=torch.int64, device=weight.device)
            if weight.element_size() == 4:
                codes = [index.to(torch.int32).view(weight.dtype)]
                widths = [32]
            else:
                codes = [((index >> s) & 0xFFFF).to(torch.int32).to(torch.int16).view(weight.dtype)
                         for s in (0, 16)]
                widths = [16, 16]
            plain_of = torch.zeros(n, dtype=torch.int64, device=weight.device)
            shift = 0
            for code, width in zip(codes, widths, strict=True):
                packed = self.pack(code.view(1, d, k).contiguous()).reshape(-1)
                bits = packed.view(torch.int32 if width == 32 else torch.int16).to(torch.int64)
                plain_of |= (bits & ((1 << width) - 1)) << shift
                shift += width
            if not torch.equal(torch.sort(plain_of).values, index):
                raise KeyError(f"the engine's expert weights are stored in an order rgc cannot "
                               f"follow ({self.name} does not permute the elements of each "
                               "expert's matrix)")
            positions = torch.empty_like(plain_of)
            positions[plain_of] = index
            self._positions[key] = positions.view(d, k)
            self._plain_index[key] = plain_of
        return self._positions[key]

    def plain_index(self, weight: torch.Tensor) -> torch.Tensor:
        """int64 ``[D K]``: the plain flat index of each stored element of an expert matrix
        (the inverse of :meth:`positions`)."""
        self.positions(weight)
        return self._plain_index[(*weight.shape[-2:], weight.dtype, weight.device)]

    def unpacked(self, weight: torch.Tensor) -> torch.Tensor:
        """A plain copy of the ``[E, D, K]`` ``weight``: one scatter (faster on the CPU than
        the gather that inverts it)."""
        matrices = weight.reshape(weight.shape[0], -1)
        return torch.empty_like(weight).view_as(matrices).index_copy_(
            1, self.plain_index(weight), matrices).view_as(weight)

    @torch.no_grad()
    def unpack_(self, weight: torch.Tensor) -> None:
        """Put each expert matrix of ``weight`` (``[E, D, K]``) in plain order, in place."""
        weight.copy_(self.unpacked(weight))

    @torch.no_grad()
    def pack_(self, weight: torch.Tensor) -> None:
        """The inverse of :meth:`unpack_`: store each plain expert matrix in packed order."""
        matrices = weight.view(weight.shape[0], -1)
        matrices.index_copy_(1, self.positions(weight).reshape(-1), matrices.clone())


@dataclass(frozen=True)
class ExpertPieces:
    """What this rank holds of a trainer stack of ``count`` experts of ``d x k`` matrices:
    ``blocks`` of the engine parameter ``param`` (``[E_local, D, K]``), stored in ``packing``'s
    order (``None``: plain)."""

    param: str
    count: int
    d: int
    k: int
    blocks: tuple[ExpertBlock, ...]
    packing: Packing | None = None

    def key(self, block: ExpertBlock) -> tuple[int, int, int, int]:
        """The block of the trainer's ``[E d, k]`` matrix that ``block`` holds."""
        return block.expert * self.d + block.row0, block.rows, block.col0, block.cols

    def _index(self, params, block: ExpertBlock, start: int, rows: int):
        weight = params[self.param]
        r0, c0 = block.local_row0 + start, block.local_col0
        if self.packing is None:
            return weight[block.slot, r0:r0 + rows, c0:c0 + block.cols], None
        positions = self.packing.positions(weight)[r0:r0 + rows, c0:c0 + block.cols]
        return weight.view(weight.shape[0], -1)[block.slot], positions

    def get(self, params, block: ExpertBlock, start: int = 0, rows: int | None = None
            ) -> torch.Tensor:
        """Rows ``[start, start + rows)`` of ``block`` (a view when the storage is plain)."""
        target, positions = self._index(params, block, start,
                                        block.rows - start if rows is None else rows)
        return target if positions is None else target[positions]

    def put(self, params, block: ExpertBlock, start: int, values: torch.Tensor) -> None:
        """Write ``values`` into rows ``[start, start + len(values))`` of ``block``."""
        target, positions = self._index(params, block, start, values.shape[0])
        if positions is None:
            target.copy_(values)
        else:
            target[positions] = values

    def whole(self, params) -> bool:
        """True when the engine's parameter, read in plain order, is the trainer's whole
        ``[E, d, k]`` stack: every expert here as local expert ``e``, unsharded, unpadded."""
        weight = params[self.param]
        rows = [0] * self.count
        for b in self.blocks:
            if (b.slot, b.local_row0, b.local_col0, b.col0, b.cols) != (b.expert, b.row0, 0, 0,
                                                                          self.k):
                return False
            rows[b.expert] += b.rows
        return tuple(weight.shape) == (self.count, self.d, self.k) and rows == [self.d] * len(
            rows)

    def get_experts(self, params, experts: range) -> torch.Tensor:
        """A copy of the plain ``[len(experts), d, k]`` matrices of ``experts`` (a
        :meth:`whole` stack): one gather for all of them."""
        weight = params[self.param][experts.start:experts.stop]
        if self.packing is None:
            return weight.clone()
        return self.packing.unpacked(weight)

    def put_experts(self, params, experts: range, values: torch.Tensor) -> None:
        """Write plain ``[len(experts), d, k]`` ``values`` into ``experts`` (a :meth:`whole`
        stack): one scatter for all of them."""
        weight = params[self.param][experts.start:experts.stop]
        if self.packing is None:
            weight.copy_(values)
            return
        flat = self.packing.positions(weight).reshape(-1)
        weight.view(len(experts), -1).index_copy_(1, flat, values.reshape(len(experts), -1))


def _routed_experts(model: nn.Module, path: str):
    """``(vLLM's RoutedExperts layer at path or inside the MoE runner there, its path)``, or
    None."""
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
    except ImportError:
        return None
    try:
        module = model.get_submodule(path)
    except AttributeError:
        return None
    if isinstance(getattr(module, "routed_experts", None), RoutedExperts):
        return module.routed_experts, f"{path}.routed_experts"
    return (module, path) if isinstance(module, RoutedExperts) else None


#: One :class:`Packing` per backend kind (their positions are cached per shape and dtype).
_PACKINGS: dict[str, Packing] = {}


def expert_packing(routed) -> Packing | None:
    """How ``routed``'s backend stores each expert matrix: ``None`` for plain ``[E, D, K]``.

    Known: vLLM's CPU kernels, which prepack ``w13``/``w2`` for their grouped GEMM (a
    :class:`Packing` through the engine's own prepack op; plain when they run zentorch), and
    the Triton kernels (plain). Raises ``KeyError`` for other backends (which may shuffle,
    swap or pad the weights: FlashInfer, AITER, ...).
    """
    method = routed.quant_method
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import (
        UnquantizedFusedMoEMethod,
    )

    if not isinstance(method, UnquantizedFusedMoEMethod):
        raise KeyError(f"the engine's experts at {routed.layer_name!r} are quantized "
                       f"({type(method).__name__}); rgc updates unquantized weights only")
    backend = method.unquantized_backend.name
    if backend == "CPU":
        experts = method.moe_kernel.fused_experts
        if getattr(experts, "_use_zentorch", False):
            return None
        from vllm._custom_ops import cpu_prepack_moe_weight

        isa = experts.isa
        name = f"CPU prepack ({isa})"
        if name not in _PACKINGS:
            _PACKINGS[name] = Packing(lambda w: cpu_prepack_moe_weight(w, isa), name)
        return _PACKINGS[name]
    if backend in ("TRITON", "BATCHED_TRITON"):
        return None
    raise KeyError(f"the engine's experts at {routed.layer_name!r} run the {backend} "
                   "backend, whose weight layout rgc does not know")


_EXPERT_WEIGHTS = {"gate_up_proj": "w13_weight", "up_proj": "w13_weight",
                   "down_proj": "w2_weight"}


def locate_experts(routed, attr: str, engine_path: str) -> ExpertPieces:
    """The :class:`ExpertPieces` of the trainer's stacked expert weight ``attr``
    (``gate_up_proj``, ``up_proj`` or ``down_proj``) in the fused-MoE layer ``routed`` (at
    ``engine_path`` in the engine's model), as its weight loader places the trainer's fused
    tensors. Raises ``KeyError`` for a layout rgc does not write."""
    config = routed.moe_config
    manager = routed.expert_map_manager
    if config.num_experts != config.num_logical_experts:
        raise KeyError(f"the engine keeps redundant copies of experts at "
                       f"{routed.layer_name!r} (EPLB); rgc does not update them")
    if getattr(manager, "num_fused_shared_experts", 0):
        raise KeyError(f"the engine fuses shared experts into {routed.layer_name!r}; rgc "
                       "does not update them")
    gated = config.is_act_and_mul
    if attr not in ("down_proj", "gate_up_proj" if gated else "up_proj"):
        raise KeyError(f"the engine's experts at {routed.layer_name!r} hold no {attr!r} "
                       f"({'gated' if gated else 'not gated'})")
    name = _EXPERT_WEIGHTS[attr]
    weight = getattr(routed, name)
    if weight.dim() != 3:
        raise KeyError(f"the engine's {engine_path}.{name} is not a [E, D, K] stack")
    packing = expert_packing(routed)
    tp, rank = config.moe_parallel_config.tp_size, config.moe_parallel_config.tp_rank
    hidden, inter = config.hidden_dim_unpadded, config.intermediate_size
    share = inter // tp
    if name == "w2_weight":
        d, k = hidden, inter
        parts = [(0, 0, 0, hidden, rank * share, share)]
    else:
        d, k = (2 if gated else 1) * inter, hidden
        half = weight.shape[1] // 2
        parts = [(0, 0, rank * share, share, 0, hidden)]
        if gated:
            parts.append((half, 0, inter + rank * share, share, 0, hidden))
    blocks = []
    for expert in range(config.num_logical_experts):
        slot = routed._map_global_expert_id_to_local_expert_id(expert)
        if slot < 0:
            continue
        blocks += [ExpertBlock(expert, slot, lr, lc, r0, rows, c0, cols)
                   for lr, lc, r0, rows, c0, cols in parts]
    return ExpertPieces(f"{engine_path}.{name}", config.num_logical_experts, d, k,
                        tuple(blocks), packing)


def _locate_stack(model: nn.Module, name: str) -> ExpertPieces | None:
    """The :class:`ExpertPieces` of ``name`` if the engine holds it in a fused-MoE layer."""
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    mapped = name
    if mapper is not None:
        result = mapper._map_name_with_shard(name)
        if result is None or result[1] is not None:
            return None
        mapped = result[0]
    path, _, attr = mapped.rpartition(".")
    found = _routed_experts(model, path)
    return None if found is None else locate_experts(found[0], attr, found[1])


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
