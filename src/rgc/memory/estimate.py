"""Predict training memory before training: :func:`estimate_memory`.

The model is described by its layer shapes (:class:`ModelSpec`), taken from an ``nn.Module``
or computed from the numbers of a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3,
GPT-2), with no network access and without building the model. Mixture-of-experts configs
(:data:`MOE_FAMILIES`: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM4-MoE, gpt-oss) are
read by building the model from the config on the ``meta`` device with ``transformers`` (no
memory, no download; a few seconds at 235B), which gives the exact shapes and dtypes of every
parameter; each 3-D expert weight is one :class:`LinearShape` with ``experts = E``.

Methods. Each method is a plan function returning what it keeps, what backward allocates and
``zero_grad`` frees, and its transients (:class:`_Plan`), registered in ``_METHODS``: rgc and
RowAdam, LoRA, dense AdamW, and the memory-efficient peers (BF16, 8-bit and 4-bit AdamW,
GaLore, APOLLO). ``benchmarks/peers.py`` measures them side by side.

Peak model. One training step is forward, backward, optimizer step, then
``zero_grad(set_to_none=True)``. What a method keeps from step to step (weights, projections,
optimizer state, an FP32 master copy) is always live. On top of it the peak is the largest of
three moments:

* start of backward: every saved activation plus the loss's transient gradients;
* expert backward (LoRA and dense AdamW on expert stacks): the activations of the decoder
  layers plus the dense gradient of one expert stack, which their backward forms (a bound:
  the last layer's own activations are partly freed by then; AdamW's transients there are
  in :func:`_plan_adamw`);
* end of backward: all of this step's gradients (RGC's sketches, LoRA's adapter gradients;
  for AdamW, which keeps FP32 gradient buffers, the embedding's transient BF16 gradient);
* optimizer step: the gradients plus the step's largest temporaries.

The backward transients of the layers themselves (an RMSNorm's FP32 input gradient, a few
n x h FP32 tensors; an experts block's row gradients, a few S x h ones) are assumed below the
loss's (8 bytes per token and vocabulary entry), which holds for real vocabularies (the tests'
models have one of 2000 entries).

The activation model is written for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) and
the mixture-of-experts families :data:`MOE_ACTIVATION_FAMILIES` (Qwen3-MoE, Mixtral: the same
attention, a softmax top-k router and routed experts, sketched by rgc or computed by
transformers' ``grouped_mm`` experts) as implemented by ``transformers`` with SDPA attention (a
fused kernel saving out and logsumexp, no n x n attention matrix), no padding mask,
``use_cache=False``, and the loss ``ForCausalLMLoss`` (FP32 upcast of the logits, log_softmax,
NLL). It is exact, to the byte, for the tensors autograd saves in that implementation
(``tests/test_memory_estimate.py`` checks it against a measured forward). The other
mixture-of-experts families are estimated without the batch's activations.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn

from rgc.experts import expert_weight_names
from rgc.ops import reference, triton_buffers
from rgc.optim.rules import FLOAT64_CHUNK
from rgc.projection import check_rank
from rgc.targets import Targets, plan_targets
from rgc.updates import resolve_chunk_rows

LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
#: Mixture-of-experts model types, read through a ``meta``-device build with transformers.
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "glm4_moe",
                "gpt_oss")
FAMILIES = (*LLAMA_FAMILY, "gpt2", *MOE_FAMILIES)
#: Mixture-of-experts families whose token activations are modelled (Llama-style attention and
#: a softmax top-k router): the others give the memory of everything but the batch's.
MOE_ACTIVATION_FAMILIES = ("qwen3_moe", "mixtral")
FP32 = 4

#: Reference-path update, bytes per element of one ``chunk_rows x k`` chunk of H: the FP32
#: rebuilt rows, which the compiled pass turns into the rounded patterns in place before they
#: are stored into W (each stored chunk's norm is formed in float64 in the chunk's consumed
#: storage; ``sum_squares`` alone uses a float64 buffer of at most as many bytes). Measured
#: with the tracker on torch 2.13; ``tests/test_memory_estimate.py`` checks whole steps.
UPDATE_BYTES_PER_CHUNK_ELEMENT = 4

#: The step's device scalars of one layer (an FP32 coefficient and a bool flag, 0-dim, live
#: until its projection is refreshed), rounded up to two CUDA allocator blocks of 512 bytes.
UPDATE_SCALAR_BYTES = 1024


@dataclass(frozen=True)
class LinearShape:
    """One linear layer: qualified ``name``, weight ``d x k`` (out x in), ``bias``; or, with
    ``experts = E > 1``, a stack of E expert matrices of d x k (a 3-D expert weight, named
    like its Parameter: ``...experts.gate_up_proj``), ``bias`` meaning an ``[E, d]`` bias.
    ``conv1d``: transformers' GPT-2 ``Conv1D`` (W stored k x d), which rgc does not sketch."""

    name: str
    d: int
    k: int
    bias: bool = False
    experts: int = 1
    conv1d: bool = False

    @property
    def numel(self) -> int:
        """Weight and bias elements."""
        return self.experts * (self.d * self.k + (self.d if self.bias else 0))


@dataclass(frozen=True)
class Architecture:
    """The config numbers the activation model needs (Llama-style decoder).

    A mixture-of-experts decoder (:data:`MOE_ACTIVATION_FAMILIES`) has ``moe_layers`` layers
    of ``experts`` routed experts of width ``moe_intermediate``, ``top_k`` per token; its other
    layers have a dense MLP of width ``intermediate``. ``norm_topk``: the top-k routing weights
    are renormalised (an in-place division that saves their sum and a copy);
    ``routing_bytes``: bytes per routing weight as the experts multiply by it (Qwen3-MoE casts
    it to the logits' dtype, Mixtral keeps FP32).
    """

    family: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool
    moe_layers: int = 0
    experts: int = 0
    top_k: int = 0
    moe_intermediate: int = 0
    norm_topk: bool = False
    routing_bytes: int = 2


@dataclass(frozen=True)
class ModelSpec:
    """What the estimator needs to know of a model.

    Attributes:
        weight_bytes: parameters and buffers as stored (shared tensors counted once).
        num_params: parameter elements (shared ones once).
        linears: every linear layer (``nn.Linear``, or transformers' GPT-2 ``Conv1D`` with its
            weight read as d x k).
        arch: the decoder's numbers, if known (needed for activations).
        weight_itemsize: bytes per element of the linear weights (P is stored in this dtype).
        largest_param: elements of the largest parameter.
        param_numels: elements of each parameter (shared ones once), for the optimizers whose
            state layout depends on a parameter's size (the 8- and 4-bit ones).
        layer_numels: parameter elements of each decoder layer (``layers.<i>.``), where the
            decoder is not described by ``arch`` (FSDP2 gathers layer by layer).
    """

    weight_bytes: int
    num_params: int
    linears: tuple[LinearShape, ...]
    arch: Architecture | None = None
    weight_itemsize: int = 2
    largest_param: int = 0
    param_numels: tuple[int, ...] = ()
    layer_numels: tuple[int, ...] = ()


@dataclass(frozen=True)
class MemoryEstimate:
    """Predicted memory of one training step, in bytes.

    Full sizes of each part (zero where a method has none):
        weights: the model's parameters and buffers as stored (BF16 by default).
        sketch: RGC/RowAdam sketches C (d x r FP32 per compressed weight).
        adapters: LoRA's A (r x k) and B (d x r), FP32.
        master: AdamW's FP32 master copy of every parameter.
        projections: RGC/RowAdam projections P (k x r, weight dtype).
        optimizer_state: AdamW moments (2 x FP32 per trained element), RowAdam m (d x r FP32)
            and v (d FP32); none for RGC.
        gradients: LoRA adapter gradients, AdamW FP32 gradients, dense gradients of trainable
            non-target parameters under RGC/RowAdam.
        activations: tensors saved for backward at ``batch x seq_len`` (0 if not given), and
            what a method saves whatever the batch (peft LoRA's merged expert stacks).
        temporaries: the transient at the peak moment (loss gradients, step temporaries).
        compute_copies: with ``compute_dtype=torch.float32`` (:mod:`rgc.compute`), the largest
            transient of one upcast matmul, included in ``temporaries`` where it applies.
        matmul_scratch: with ``bf16_matmul_scratch=True``, the FP32 output buffer of the
            output layer's first backward matmul (:func:`matmul_scratch_bytes`).

    ``total`` is the predicted peak; ``at_peak`` splits it into what is live at that moment
    (its values add up to ``total``); ``phase`` names the moment ('backward start',
    'expert backward', 'backward end' or 'optimizer step'); ``state`` is the method's training
    state
    (everything but weights, activations and temporaries): the saving of RGC over LoRA
    predicted in the RGC preprint is ``lora.state - rgc.state``.
    """

    method: str
    rank: int | None
    weights: int
    sketch: int = 0
    adapters: int = 0
    master: int = 0
    projections: int = 0
    optimizer_state: int = 0
    gradients: int = 0
    activations: int = 0
    temporaries: int = 0
    compute_copies: int = 0
    matmul_scratch: int = 0
    total: int = 0
    phase: str = ""
    at_peak: dict = field(default_factory=dict)

    @property
    def state(self) -> int:
        return (self.sketch + self.adapters + self.master + self.projections
                + self.optimizer_state + self.gradients)

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {"state": self.state}


# -- model description --------------------------------------------------------------------

def _read_config(path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"no config file at {path}; pass the path of a local "
                                "Hugging Face config.json (no download is attempted)")
    return json.loads(path.read_text())


def _llama_spec(cfg: dict, family: str, itemsize: int) -> ModelSpec:
    h, i, n_layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or h // heads
    vocab = cfg["vocab_size"]
    tied = bool(cfg.get("tie_word_embeddings", False))
    qkv_bias = True if family == "qwen2" else bool(cfg.get("attention_bias", False))
    o_bias = False if family == "qwen2" else qkv_bias
    mlp_bias = bool(cfg.get("mlp_bias", False))
    q, kv = heads * hd, kv_heads * hd
    per_layer = [("self_attn.q_proj", q, h, qkv_bias), ("self_attn.k_proj", kv, h, qkv_bias),
                 ("self_attn.v_proj", kv, h, qkv_bias), ("self_attn.o_proj", h, q, o_bias),
                 ("mlp.gate_proj", i, h, mlp_bias), ("mlp.up_proj", i, h, mlp_bias),
                 ("mlp.down_proj", h, i, mlp_bias)]
    linears = [LinearShape(f"model.layers.{n}.{name}", d, k, b)
               for n in range(n_layers) for name, d, k, b in per_layer]
    norms = [h, h] + ([hd, hd] if family == "qwen3" else [])
    numels = [vocab * h, *(v for s in linears for v in ((s.d * s.k, s.d) if s.bias
                                                            else (s.d * s.k,))),
              *(norms * n_layers), h, *([] if tied else [vocab * h])]
    numel = sum(numels)
    linears.append(LinearShape("lm_head", vocab, h))  # an nn.Linear even when tied
    # The rotary embedding's FP32 buffers inv_freq and original_inv_freq (transformers >= 5).
    inv_freq = 2 * (hd // 2) * FP32
    arch = Architecture(family, h, i, n_layers, heads, kv_heads, hd, vocab, tied,
                        qk_norm=family == "qwen3")
    return ModelSpec(numel * itemsize + inv_freq, numel, tuple(linears), arch, itemsize,
                     largest_param=max(vocab * h, i * h), param_numels=tuple(numels))


def _gpt2_spec(cfg: dict, itemsize: int) -> ModelSpec:
    h, n_layers, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    inner = cfg.get("n_inner") or 4 * h
    per_layer = [("attn.c_attn", 3 * h, h), ("attn.c_proj", h, h), ("mlp.c_fc", inner, h),
                 ("mlp.c_proj", h, inner)]
    linears = [LinearShape(f"transformer.h.{n}.{name}", d, k, True, conv1d=True)
               for n in range(n_layers) for name, d, k in per_layer]
    numels = [vocab * h, cfg.get("n_positions", 1024) * h,
              *(v for s in linears for v in (s.d * s.k, s.d)), *([h] * (4 * n_layers + 2))]
    numel = sum(numels)
    linears.append(LinearShape("lm_head", vocab, h))  # tied to the token embedding
    return ModelSpec(numel * itemsize, numel, tuple(linears), None, itemsize,
                     largest_param=max(vocab * h, inner * h), param_numels=tuple(numels))


def spec_from_config(config, *, dtype: torch.dtype = torch.bfloat16) -> ModelSpec:
    """:class:`ModelSpec` from a config dict or the path of a local ``config.json``.

    Assumes the weights are stored in ``dtype`` (default BF16) and the ``transformers``
    layout of the family: Llama/Mistral/Qwen2/Qwen3 (q/k/v/o and gate/up/down projections,
    RMSNorms, Qwen3's per-head q/k norms, Qwen2's q/k/v biases, an lm_head unless
    ``tie_word_embeddings``) or GPT-2 (fused c_attn, learned positions, tied lm_head).
    """
    cfg = config if isinstance(config, dict) else _read_config(config)
    family = cfg.get("model_type")
    itemsize = torch.empty((), dtype=dtype).element_size()
    if family in LLAMA_FAMILY:
        return _llama_spec(cfg, family, itemsize)
    if family == "gpt2":
        return _gpt2_spec(cfg, itemsize)
    if family in MOE_FAMILIES:
        return _meta_spec(json.dumps(cfg, sort_keys=True), dtype)
    raise ValueError(f"unsupported model_type {family!r}; supported families: {FAMILIES}")


@functools.lru_cache(maxsize=16)
def _meta_spec(config_json: str, dtype: torch.dtype) -> ModelSpec:
    """:class:`ModelSpec` of :func:`_meta_model` (cached: the CLI asks for one spec per method
    and rank)."""
    return spec_from_module(_meta_model(config_json, dtype))


@functools.lru_cache(maxsize=16)
def _meta_model(config_json: str, dtype: torch.dtype) -> nn.Module:
    """The model of a config (its JSON text) built on the meta device (no memory)."""
    cfg = json.loads(config_json)
    try:
        import transformers
    except ImportError as e:
        raise ValueError(f"reading a {cfg['model_type']!r} config builds the model on the meta "
                         "device with transformers, which is not installed: pip install "
                         "'rgc-torch[hf]'") from e
    numbers = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype", "dtype")}
    config = transformers.AutoConfig.for_model(cfg["model_type"], **numbers)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def spec_from_module(model: nn.Module) -> ModelSpec:
    """:class:`ModelSpec` of a built model (any dtype and device, ``meta`` included).

    Linear layers are ``nn.Linear`` (a wrapped ``CompressedLinear`` too), transformers'
    ``Conv1D``, and the 3-D expert weights of transformers' Experts modules (sketched or not),
    one :class:`LinearShape` with ``experts = E`` each. If the model has a ``config`` of a
    Llama-style family or of :data:`MOE_ACTIVATION_FAMILIES`, its numbers are used for the
    activation model.
    """
    seen: set = set()
    weight_bytes = 0
    numels = []
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr()) if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        weight_bytes += t.numel() * t.element_size()
        if isinstance(t, nn.Parameter):
            numels.append(t.numel())
    linears, itemsize = [], 2
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            linears.append(LinearShape(name, m.out_features, m.in_features, m.bias is not None))
            itemsize = m.weight.element_size()
        elif type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None:
            k, d = m.weight.shape
            linears.append(LinearShape(name, d, k, getattr(m, "bias", None) is not None,
                                       conv1d=True))
        elif (weights := expert_weight_names(m)) is not None:
            for w in weights:
                experts, rows, cols = getattr(m, w).shape
                d, k = (cols, rows) if m.is_transposed else (rows, cols)
                linears.append(LinearShape(f"{name}.{w}", d, k, bool(m.has_bias), experts))
    arch = None
    cfg = getattr(model, "config", None)
    family = getattr(cfg, "model_type", None)
    if family in LLAMA_FAMILY:
        arch = _llama_spec(cfg.to_dict(), family, itemsize).arch
    elif family in MOE_ACTIVATION_FAMILIES:
        arch = _moe_arch(cfg.to_dict(), family, itemsize)
    return ModelSpec(weight_bytes, sum(numels), tuple(linears), arch, itemsize,
                     max(numels, default=0), tuple(numels), _layer_numels(model))


def _moe_arch(cfg: dict, family: str, itemsize: int) -> Architecture:
    """The :class:`Architecture` of a Qwen3-MoE or Mixtral config (transformers' names) with
    weights of ``itemsize`` bytes per element."""
    h, n_layers, heads = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"]
    # transformers 5 maps Qwen3-MoE's num_experts to num_local_experts
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if family == "qwen3_moe":
        width = cfg["moe_intermediate_size"]
        step, dense_only = cfg.get("decoder_sparse_step", 1), set(cfg.get("mlp_only_layers") or ())
        moe_layers = sum(1 for i in range(n_layers) if i not in dense_only and experts > 0
                         and (i + 1) % step == 0)
        norm_topk, routing_bytes = bool(cfg.get("norm_topk_prob", False)), itemsize
    else:  # mixtral: every layer routed, weights renormalised and kept in FP32
        width, moe_layers = cfg["intermediate_size"], n_layers
        norm_topk, routing_bytes = True, FP32
    return Architecture(family, h, cfg["intermediate_size"], n_layers, heads,
                        cfg.get("num_key_value_heads") or heads,
                        cfg.get("head_dim") or h // heads, cfg["vocab_size"],
                        bool(cfg.get("tie_word_embeddings", False)), family == "qwen3_moe",
                        moe_layers, experts, cfg["num_experts_per_tok"], width, norm_topk,
                        routing_bytes)


def _layer_numels(model: nn.Module) -> tuple[int, ...]:
    """Parameter elements per decoder layer (names with ``layers.<i>.``), in layer order."""
    per_layer: dict[int, int] = {}
    for name, p in model.named_parameters():
        found = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
        if found:
            per_layer[int(found.group(1))] = per_layer.get(int(found.group(1)), 0) + p.numel()
    return tuple(per_layer[i] for i in sorted(per_layer))


# -- estimate -----------------------------------------------------------------------------

def _stand_in(spec: ModelSpec) -> nn.Module:
    """A module tree for a spec read from a config's numbers: a ``meta``-device ``nn.Linear``
    of each layer's shape at its qualified name (nothing for GPT-2's ``Conv1D`` layers, which
    rgc does not sketch), so that targets resolve as on the built model."""
    root = nn.Module()
    for s in spec.linears:
        if s.conv1d:
            continue
        parent = root
        *path, leaf = s.name.split(".")
        for part in path:
            if not hasattr(parent, part):
                parent.add_module(part, nn.Module())
            parent = getattr(parent, part)
        parent.add_module(leaf, nn.Linear(s.k, s.d, bias=s.bias, device="meta"))
    return root


def _chosen(model_or_config, spec: ModelSpec, targets, dtype: torch.dtype
            ) -> list[LinearShape]:
    """The :class:`LinearShape` of every weight ``targets`` picks, as :func:`rgc.wrap` would
    (:func:`rgc.targets.plan_targets` on the module, the meta-built model of a
    mixture-of-experts config, or the :func:`_stand_in` of another config)."""
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
    else:
        cfg = (model_or_config if isinstance(model_or_config, dict)
               else _read_config(model_or_config))
        model = (_meta_model(json.dumps(cfg, sort_keys=True), dtype)
                 if cfg.get("model_type") in MOE_FAMILIES else _stand_in(spec))
    names = plan_targets(model, targets).weight_names()
    return [s for s in spec.linears if s.name in names]


def _activations(arch: Architecture, mode: str, rank: int, n: int, seq_len: int,
                 wsize: int, targets: list[LinearShape]) -> tuple[int, int, int]:
    """(saved activations, loss transient at backward start, saved by the model's head) in
    bytes for n tokens; the head's part (final norm onwards) is freed before the decoder
    layers' backward.

    ``mode`` says what is trained: 'dense' (every parameter), 'targets' (the targets' weights
    with dense gradients, everything else frozen: GaLore, APOLLO), 'sketch' (rgc, RowAdam) or
    'lora'.

    Per decoder layer (h hidden, i intermediate, q = heads * head_dim, c = kv_heads * head_dim,
    a heads, g kv heads; BF16 = 2 bytes, FP32 = 4), what autograd saves:

    * each RMSNorm: its FP32 input (4nh) and 1/rms (4n); 'dense' also the normalised BF16
      tensor (2nh) for the norm weight's gradient; 'dense' and 'targets' the norm's output
      (2nh), the next linears' input; Qwen3's q/k norms the same on q and c with a and g rows
      (their normalised tensors in 'dense' only, their outputs are q and k);
    * attention (SDPA): q and its output (2nq each), k and v (2nc each), FP32 logsumexp (4na);
    * MLP: gate and up outputs and SiLU(gate) (3 x 2ni); 'dense' and 'targets' also
      SiLU(gate)*up (2ni), down_proj's input; a mixture-of-experts layer instead
      :func:`_moe_layer_activations`;
    * per target linear: 'sketch' ``X P`` (n x r, weight dtype); 'lora' the FP32 copy of its
      input (4nk, one per target: peft casts x for each adapter) and ``A x`` (4nr); per
      target expert stack: 'sketch' ``X P`` per token (gate/up) or per routed row (down),
      'lora' the stack's BF16 input per routed row.

    The terms other than the targets' assume at least one target in the attention and one in
    the MLP of every layer (the default targets are all seven projections).

    The first layer's input norm saves its input and 1/rms only if the embedding is trained
    ('dense'). Model level: the embedding's int64 ids ('dense'), RoPE cos and sin (2 x seq x
    head_dim, shared by all layers), the final norm (and, 'dense', its normalised tensor and
    output for the norm weight's and the lm_head's gradients), the FP32 log_softmax of the
    logits (4nV) and the int64 targets. The loss transient at backward start is the NLL and
    log_softmax input gradients, 2 x 4nV.
    """
    h, i, q = arch.hidden, arch.intermediate, arch.heads * arch.head_dim
    c, a, g, V = arch.kv_heads * arch.head_dim, arch.heads, arch.kv_heads, arch.vocab
    dense = mode == "dense"
    inputs = mode in ("dense", "targets")  # linears save their input X
    norm = 4 * n * h + 4 * n + (2 * n * h if dense else 0) + (2 * n * h if inputs else 0)
    qk = 0
    if arch.qk_norm:
        qk = 4 * n * (q + c) + 4 * n * (a + g) + (2 * n * (q + c) if dense else 0)
    attention = 2 * n * (2 * q + 2 * c) + 4 * n * a
    mlp = 6 * n * i + (2 * n * i if inputs else 0)
    routed = n * arch.top_k  # rows of the experts' products
    saved_by_targets = 0
    for s in targets:
        if mode == "sketch":
            rows = routed if s.experts > 1 and _is_down_stack(s) else n
            saved_by_targets += rows * rank * wsize
        elif mode == "lora":
            saved_by_targets += (routed * s.k * wsize if s.experts > 1
                                 else 4 * n * s.k + 4 * n * rank)
    total = (arch.layers * (2 * norm + qk + attention) + (arch.layers - arch.moe_layers) * mlp
             + arch.moe_layers * _moe_layer_activations(arch, n, wsize, dense)
             + saved_by_targets)
    if not dense:
        total -= 4 * n * h + 4 * n  # the first layer's input norm
    total += 8 * n if dense else 0  # embedding ids
    total += 2 * seq_len * arch.head_dim * wsize  # cos, sin
    # the final norm, log_softmax, targets and loss: freed before the decoder layers' backward
    head = 4 * n * h + 4 * n + (4 * n * h if dense else 0) + 4 * n * V + 8 * n + FP32
    return total + head, 2 * 4 * n * V, head


def _is_down_stack(s: LinearShape) -> bool:
    """True for the down projection of an experts layer (its input differs per routed row)."""
    return s.name.rsplit(".", 1)[-1] == "down_proj"


def _moe_layer_activations(arch: Architecture, n: int, wsize: int, dense: bool) -> int:
    """Bytes a mixture-of-experts block saves for ``n`` tokens, beyond its expert weights' own
    terms (``X P`` of sketched stacks, the inputs of LoRA-adapted ones: see
    :func:`_activations`).

    With E experts, S = n top_k routed rows, i the experts' width, h hidden, w the weights'
    bytes per element: the router's FP32 softmax (4nE) and int64 top-k indices (8S), with
    ``norm_topk`` the FP32 sum and unnormalised weights of the division (4n + 4S); the int64
    row-to-token index, sort permutation and its inverse (3 x 8S), the int32 offsets (4E) and
    the routing weights of the rows (S ``routing_bytes``); the gate/up output (2Si w), SiLU of
    the gate (Si w) and the down output (Sh w), kept for the product with the routing weights.
    'dense' also saves the input of both stacks (S h w and S i w; the router's input is the
    norm's output, counted with the norm). Measured on transformers 5.24's Qwen3-MoE and
    Mixtral, rgc's sketched experts and transformers' ``grouped_mm`` experts alike.
    """
    routed, width, E = n * arch.top_k, arch.moe_intermediate, arch.experts
    router = 4 * n * E + 8 * routed + (4 * n + 4 * routed if arch.norm_topk else 0)
    routing = 3 * 8 * routed + 4 * E + arch.routing_bytes * routed
    experts = routed * (3 * width + arch.hidden) * wsize
    if dense:
        experts += routed * (arch.hidden + width) * wsize
    return router + routing + experts


def _refresh_temp(k: int, r: int, weight_itemsize: int = 2, implementation: str = "torch",
                  projections: int = 1) -> int:
    # the orthonormal refresh of the ``projections`` P of this shape (one make_projections_
    # call, in chunks), P in the weights' dtype (a float64 Gram unless BF16)
    if implementation == "triton":
        return triton_buffers.make_projections_bytes(k, r, projections)
    return reference.make_projections_bytes(k, r, weight_itemsize != 2, projections)


def _update_temp(d: int, k: int, r: int, chunk_rows: int | None, implementation: str) -> int:
    # an FP32 copy of P plus the chunk of H and the scaled chunk of C (none on the Triton kernel)
    if implementation == "triton":
        return 4 * k * r
    rows = min(resolve_chunk_rows(chunk_rows, k), d)
    return 4 * k * r + rows * (k * UPDATE_BYTES_PER_CHUNK_ELEMENT + 4 * r)


def _norm_temp(d: int, k: int, r: int, experts: int = 1, implementation: str = "torch") -> int:
    # ||C P^T||^2 and finiteness of one stack (rgc.ops.sketch_stats)
    if implementation == "triton":
        return triton_buffers.sketch_stats_bytes(experts, d, r)
    return reference.sketch_stats_bytes(experts, d, k, r)


def rgc_step_temporaries(d: int, k: int, r: int, *, chunk_rows: int | None = None,
                         implementation: str = "torch", weight_itemsize: int = 2,
                         experts: int = 1, projections: int = 1) -> int:
    """Largest transient of one RGCOptimizer update of a d x k weight at rank r, in bytes.

    The largest of: ``||H||`` from the Grams and the finiteness of C (the reference: P,
    ``P^T P`` and ``C^T C`` in float64, 8kr + 16r^2, beside a float64 chunk of C's rows); the
    update (4kr plus :data:`UPDATE_BYTES_PER_CHUNK_ELEMENT` per chunk element); regenerating
    P after the step: the ``projections`` of this shape (those of every target with this k)
    in one call, in chunks. The first and the last are the ops' own counts of their buffers:
    ``sketch_stats_bytes`` and ``make_projections_bytes`` of :mod:`rgc.ops.reference`
    (``implementation='torch'``) or of :mod:`rgc.ops.triton_buffers` (``'triton'``).

    A stack of ``experts`` matrices takes the same step matrix by matrix: its largest
    transient is one matrix's, but for its sums per expert.
    """
    return UPDATE_SCALAR_BYTES + max(
        _norm_temp(d, k, r, experts, implementation),
        _update_temp(d, k, r, chunk_rows, implementation),
        _refresh_temp(k, r, weight_itemsize, implementation, projections))


def rowadam_step_temporaries(d: int, k: int, r: int, *, chunk_rows: int | None = None,
                             implementation: str = "torch", weight_itemsize: int = 2,
                             experts: int = 1, old_projections: int | None = None,
                             projections: int = 1) -> int:
    """Largest transient of one RowAdam update of a d x k weight at rank r, in bytes.

    The finiteness check and ``||C P^T||`` (as RGC's, which tell a skipped or, for experts, an
    empty sketch), the moment update (the new m, selected where the sketch is finite: 8dr);
    the direction U is written into the sketch, and the update runs as RGC's. After the
    updates, RowAdam copies the old P of every weight it refreshes (``old_projections`` bytes
    in all; default this weight's own, k r ``weight_itemsize``), regenerates the projections
    (as RGC's) and carries m into each new basis (float64 copies of both P and r x r products,
    16kr + 16r^2, then the new m, the float64 change of basis and a float64 chunk of m with its
    product, 4dr + 12r^2 + 16 min(dr, FLOAT64_CHUNK)).
    A stack of ``experts`` matrices: dr terms over the whole stack, as
    :func:`rgc_step_temporaries`.
    """
    return _carrying_step_temporaries(d, k, r, 8, chunk_rows, implementation, weight_itemsize,
                                      experts, old_projections, projections)


def momentum_step_temporaries(d: int, k: int, r: int, *, chunk_rows: int | None = None,
                              implementation: str = "torch", weight_itemsize: int = 2,
                              experts: int = 1, old_projections: int | None = None,
                              projections: int = 1) -> int:
    """Largest transient of one RGCOptimizer update with momentum of a d x k weight at rank r.

    As :func:`rgc_step_temporaries`, and: the momentum step before the sums (the new buffer,
    its selected copy, and with Nesterov the direction and its selected copy: 12dr at most;
    ``rgc.optim.rules.sketch_momentum_``); after the updates, the copies of every refreshed
    weight's old P (``old_projections``) beside the regeneration or the buffer's carry into
    the new basis (:func:`rowadam_step_temporaries` counts the same carry).
    """
    return _carrying_step_temporaries(d, k, r, 12, chunk_rows, implementation, weight_itemsize,
                                      experts, old_projections, projections)


def _carrying_step_temporaries(d, k, r, state_bytes_per_dr, chunk_rows, implementation,
                               weight_itemsize, experts, old_projections, projections) -> int:
    """The step of a rule with a d x r state carried into each new P: its state update
    (``state_bytes_per_dr`` per element of the stack's sketch), the sums, the update, and the
    old projections beside the regeneration or the carry."""
    dr = experts * d * r
    if old_projections is None:
        old_projections = k * r * weight_itemsize
    carry = max(16 * k * r + 16 * r * r, 4 * dr + 12 * r * r + 16 * min(dr, FLOAT64_CHUNK))
    return UPDATE_SCALAR_BYTES + max(
        state_bytes_per_dr * dr, _norm_temp(d, k, r, experts, implementation),
        _update_temp(d, k, r, chunk_rows, implementation),
        old_projections + max(_refresh_temp(k, r, weight_itemsize, implementation, projections),
                              carry))


# -- compute mode (rgc.compute): FP32 matmuls on low-precision weights ----------------------

def compute_copy_bytes(linears: Iterable[LinearShape], n_tokens: int = 0) -> int:
    """Largest transient of one FP32-computed linear layer on ``n_tokens`` tokens, in bytes.

    Under :func:`rgc.compute.use_compute_dtype` each matmul of a d x k linear layer (targets
    and the others, e.g. lm_head) makes FP32 copies of its weight (4dk) and input (4nk) and an
    FP32 result (4nd) that live until it returns; the input-gradient matmul of backward has
    the same sizes. Attention run by SDPA is not upcast and adds nothing, nor do expert stacks
    (their grouped products run in the weights' dtype).
    """
    return max((4 * (s.d * s.k + n_tokens * s.k + n_tokens * s.d) for s in linears
                if s.experts == 1), default=0)


def matmul_scratch_bytes(head: LinearShape, n_tokens: int, weight_gradient: bool) -> int:
    """FP32 output buffer, in bytes, of the output layer's first backward matmul on a CPU whose
    BF16 matmuls accumulate into one (:func:`rgc.compute.bf16_matmul_scratch`).

    ``head``: the output layer (d x k: vocabulary x hidden). Its weight gradient (d x k) where
    the method trains it (``weight_gradient``: dense AdamW and its variants), else its input
    gradient (n x k).
    """
    return 4 * (head.d * head.k if weight_gradient else n_tokens * head.k)


def _with_compute_copies(phases: dict, copies: int) -> dict:
    """Add ``copies`` to the transient of the phases in which the model's matmuls run.

    A bound: the largest copy is assumed to coincide with the loss transient at backward
    start and with the end-of-backward transient (the optimizer step computes in FP32 anyway).
    """
    return {name: (grads, temp + copies, acts) if name != "optimizer step" else (grads, temp,
                                                                                   acts)
            for name, (grads, temp, acts) in phases.items()}


# -- what each method keeps -----------------------------------------------------------------

@dataclass(frozen=True)
class _Plan:
    """One method's memory: full sizes of its parts (``MemoryEstimate`` field names), which of
    them backward allocates and ``zero_grad`` frees, the largest transients of the optimizer
    step and of the end of backward, what autograd saves (a mode of :func:`_activations`) and
    saved bytes that do not depend on the batch (``fixed_activations``), and the largest
    transient of backward beside the activations other than the loss's (``backward_temp``:
    the dense gradient of an expert stack that LoRA's and AdamW's backward forms).
    """

    parts: dict
    per_step: tuple = ()
    step_temp: int = 0
    end_temp: int = 0
    activations: str = "dense"
    fixed_activations: int = 0
    backward_temp: int = 0


def _tied_embedding_transient(spec: ModelSpec, copies: int) -> int:
    """``copies`` V x h BF16 tensors at the end of backward when the embedding is tied.

    The lm_head's gradient contribution is held by autograd from the start of backward until
    the embedding's arrives; autograd sums the two before accumulating.
    """
    tied = spec.arch is not None and spec.arch.tied
    return copies * spec.largest_param * spec.weight_itemsize if tied else 0


def _plan_sketch(spec, chosen, rank, *, method, chunk_rows, implementation):
    """Per target (E = ``experts``: 1 for a linear layer): C (E x d x r FP32), one P (k x r);
    RowAdam's m (E x d x r FP32) and v (E x d FP32)."""
    wsize = spec.weight_itemsize
    parts = {"sketch": sum(s.experts * s.d * rank * FP32 for s in chosen),
             "projections": sum(s.k * rank * wsize for s in chosen),
             # trainable biases of the targets keep a dense gradient
             "gradients": sum(s.experts * s.d * wsize for s in chosen if s.bias),
             # RGCOptimizer: counters and 0-dim norms per layer, nothing per element
             "optimizer_state": 0}
    temps = rgc_step_temporaries
    if method == "rgc-momentum":
        temps = functools.partial(momentum_step_temporaries,
                                  old_projections=parts["projections"])
        parts["optimizer_state"] = sum(s.experts * s.d * rank * FP32 for s in chosen)
    if method == "rowadam":
        # the copies of every old P are held while the projections are regenerated
        temps = functools.partial(rowadam_step_temporaries,
                                  old_projections=parts["projections"])
        # m and v per target, and elementwise AdamW moments of the targets' trainable biases
        parts["optimizer_state"] = sum(s.experts * (s.d * rank * FP32 + s.d * FP32)
                                       for s in chosen)
        parts["optimizer_state"] += sum(2 * s.experts * s.d * FP32 for s in chosen if s.bias)
    same_k = {k: sum(1 for s in chosen if s.k == k) for k in {s.k for s in chosen}}
    step_temp = max(temps(s.d, s.k, rank, chunk_rows=chunk_rows, implementation=implementation,
                          weight_itemsize=wsize, experts=s.experts, projections=same_k[s.k])
                    for s in chosen)
    return _Plan(parts, ("sketch", "gradients"), step_temp, activations="sketch")


def _plan_lora(spec, chosen, rank, **_):
    """peft LoRA: A (r x k) and B (d x r) in FP32 per matrix; on an expert stack (peft's
    ``target_parameters``) A is (E r) x k and B d x (E r), the same count per expert.

    On an expert stack peft forms ``W + B A`` of the whole stack in every forward (a
    parametrization, one ``baddbmm`` of the stack and the factors cast to its dtype), and
    autograd keeps for backward the merged copy of every targeted stack (E d k in the weight
    dtype) and, for BF16 or FP16 stacks, the cast factors (E r (d + k)); FP32 factors are
    views of the adapters. Independent of the batch, counted in ``activations`` (measured with
    peft 0.21 on a tiny Qwen3-MoE).
    """
    adapter = sum(s.experts * rank * (s.d + s.k) for s in chosen) * FP32
    parts = {"adapters": adapter, "gradients": adapter, "optimizer_state": 2 * adapter}
    wsize = spec.weight_itemsize
    stacks = [s for s in chosen if s.experts > 1]
    merged = sum(s.experts * (s.d * s.k + (rank * (s.d + s.k) if wsize < FP32 else 0)) * wsize
                 for s in stacks)
    # backward of a merged stack: its dense gradient (E d k), then the factors' (E r (d + k))
    grad = max((s.experts * (s.d * s.k + rank * (s.d + s.k)) * wsize for s in stacks), default=0)
    return _Plan(parts, ("gradients",), activations="lora", fixed_activations=merged,
                 backward_temp=grad)


def _plan_adamw(spec, chosen, rank, *, implementation, **_):
    """The FP32-master recipe: see :func:`estimate_memory`.

    Expert backward: an expert stack's BF16 gradient arrives while the earlier layers'
    activations are live; on the CPU (``implementation='torch'``) the hook's ``add_`` into
    the FP32 buffer first promotes it to an FP32 copy (measured; CUDA's kernel casts as it
    reads, assumed); a tied embedding's lm_head contribution is held from the start of
    backward.
    """
    n = spec.num_params * FP32
    parts = {"master": n, "gradients": n, "optimizer_state": 2 * n}
    # The BF16 gradient of the largest parameter (the embedding) before the hook adds it into
    # its FP32 buffer; tied: the lm_head's and the embedding's contributions and their sum.
    end = _tied_embedding_transient(spec, 3) or spec.largest_param * spec.weight_itemsize
    stack = max((s.experts * s.d * s.k for s in spec.linears if s.experts > 1), default=0)
    per_element = spec.weight_itemsize + (FP32 if implementation == "torch" else 0)
    backward = stack * per_element + _tied_embedding_transient(spec, 1) if stack else 0
    return _Plan(parts, (), end_temp=end, backward_temp=backward)


def _quantized_state(numel: int, wsize: int, *, bits: int, block: int, qmap: int,
                     small: int | None = None, divisible: bool = True) -> int:
    """Bytes of one block-quantized optimizer state of a ``numel``-element parameter.

    Tensors of at least 4096 elements (and, for torchao, a multiple of ``block``) store
    ``bits``-bit codes, an FP32 scale per block and a ``qmap`` of FP32 code values; smaller
    ones a plain tensor of ``small`` bytes per element (default: the parameter's dtype).
    """
    if numel >= 4096 and (not divisible or numel % block == 0):
        return numel * bits // 8 + FP32 * -(-numel // block) + FP32 * qmap
    return numel * (wsize if small is None else small)


def _plan_bf16_dense(spec, chosen, rank, *, method, implementation, **_):
    """AdamW variants that train every parameter in its own dtype (BF16 gradients)."""
    wsize = spec.weight_itemsize
    numels = spec.param_numels
    if method in ("adamw-bf16", "adamw-bf16-sr"):  # moments in the parameter dtype
        state = sum(2 * v * wsize for v in numels)
    elif method == "adamw8bit":  # torchao OptimState8bit: block 256, 256-entry qmap
        state = sum(2 * _quantized_state(v, wsize, bits=8, block=256, qmap=256) for v in numels)
    elif method == "adamw4bit":  # torchao OptimState4bit: block 128, 16-entry qmap
        state = sum(2 * _quantized_state(v, wsize, bits=4, block=128, qmap=16) for v in numels)
    else:  # bitsandbytes: blockwise 256, FP32 states below 4096 elements, one shared qmap
        state = sum(2 * _quantized_state(v, wsize, bits=8, block=256, qmap=0, small=FP32,
                                         divisible=False) for v in numels) + 2 * 256 * FP32
    if method != "bnb-adamw8bit":  # the step count, a 0-d FP32 tensor per parameter
        state += FP32 * len(numels)
    parts = {"gradients": spec.num_params * wsize, "optimizer_state": state}
    per_element = DENSE_STEP_TEMPORARIES.get((method, implementation), 0)
    step_temp = int(per_element * spec.largest_param)
    return _Plan(parts, ("gradients",), step_temp, _tied_embedding_transient(spec, 2))


def _plan_projected(spec, chosen, rank, *, method, **_):
    """GaLore and APOLLO on the targets' weights (everything else frozen), moments in BF16.

    Per d x k target: the projection (min(d, k) x r: GaLore's SVD basis, APOLLO's random
    matrix), two moments of the projected gradient (max(d, k) x r), the dense BF16 gradient.
    The steady step's largest transient: the projected gradient, the denominator and the
    normalised update (3 max(d, k) r), and two d x k tensors (GaLore: the projected-back
    update and its scaled copy; APOLLO: the scaled gradient and its norm-limited copy).
    """
    stacks = [s.name for s in chosen if s.experts > 1]
    if stacks:
        raise ValueError(f"{method} updates 2-D weights; the targets include 3-D expert stacks "
                         f"({stacks[0]}, ...): leave them out with targets=")
    wsize = spec.weight_itemsize
    r = 1 if method == "apollo-mini" else rank
    parts = {"projections": sum(min(s.d, s.k) * r * wsize for s in chosen),
             "optimizer_state": sum(2 * max(s.d, s.k) * r * wsize for s in chosen),
             "gradients": sum(s.d * s.k * wsize for s in chosen)}
    step_temp = max((2 * s.d * s.k + 3 * max(s.d, s.k) * r) * wsize for s in chosen)
    return _Plan(parts, ("gradients",), step_temp, activations="targets")


#: Step temporaries of the low-bit AdamW steps in bytes per element of the largest parameter,
#: keyed by (method, implementation), measured with the profiler's allocator events (torch
#: 2.13, torchao 0.18, bitsandbytes 0.50; ``tests/test_memory_estimate.py``). torchao's step,
#: compiled by inductor, materialises FP32 moments of the parameter being updated and new block
#: scales (8-bit: 8 bytes per element; 4-bit: 26); the figures measured on the CPU
#: are assumed for GPUs too. bitsandbytes' CPU step dequantizes to FP32 (24 bytes per
#: element); its CUDA kernel updates in place (none).
DENSE_STEP_TEMPORARIES: dict[tuple[str, str], float] = {
    ("adamw8bit", "torch"): 8 + 2 * FP32 / 256, ("adamw8bit", "triton"): 8 + 2 * FP32 / 256,
    ("adamw4bit", "torch"): 26 + 2 * FP32 / 128, ("adamw4bit", "triton"): 26 + 2 * FP32 / 128,
    ("bnb-adamw8bit", "torch"): 24,
}

#: Method name -> (plan, needs a rank, targets layers, supported under FSDP2).
_METHODS = {
    "rgc": (_plan_sketch, True, True, True),
    "rowadam": (_plan_sketch, True, True, True),
    "rgc-momentum": (_plan_sketch, True, True, True),
    "lora": (_plan_lora, True, True, True),
    "adamw": (_plan_adamw, False, False, True),
    "adamw-bf16": (_plan_bf16_dense, False, False, True),
    "adamw-bf16-sr": (_plan_bf16_dense, False, False, True),
    "adamw8bit": (_plan_bf16_dense, False, False, True),
    "adamw4bit": (_plan_bf16_dense, False, False, True),
    "bnb-adamw8bit": (_plan_bf16_dense, False, False, True),
    "galore": (_plan_projected, True, True, False),
    "apollo": (_plan_projected, True, True, False),
    "apollo-mini": (_plan_projected, False, True, False),
}
METHODS = tuple(_METHODS)
#: The methods that take a rank.
RANKED = tuple(m for m, (_, ranked, _, _) in _METHODS.items() if ranked)
#: Parts that FSDP2 shards over the GPUs (the others, rgc's sketches and projections, are whole
#: on every GPU).
_SHARDED = ("weights", "master", "optimizer_state", "gradients", "adapters")


def _fsdp_gathered(spec: ModelSpec) -> tuple[int, int]:
    """Unsharded weights live under FSDP2 (bytes): ``(at backward start, later in backward)``.

    The root module's parameters (embedding, final norm, untied lm_head) stay gathered from
    forward to the end of backward. When backward starts (the loss), the root's pre-backward
    has issued the all-gather of the last decoder layer: one layer's buffer. While a layer
    computes its backward the next one is prefetched: two layers (for a model read through its
    parameters, the two largest). Measured with ``rgc.memory.track`` on 2 gloo processes
    (``tests/test_memory_estimate.py``).
    """
    wsize = spec.weight_itemsize
    if (spec.arch is None or spec.arch.moe_layers) and spec.layer_numels:
        # a decoder described by its parameters (mixture of experts): the root's parameters
        # (everything outside the layers) and the largest layers
        root = spec.num_params - sum(spec.layer_numels)
        largest = sorted(spec.layer_numels)[-2:]
        return (root + largest[-1]) * wsize, (root + sum(largest)) * wsize
    if spec.arch is None:
        return spec.largest_param * wsize, 2 * spec.largest_param * wsize
    a = spec.arch
    layer = sum(s.d * s.k + (s.d if s.bias else 0) for s in spec.linears
                if s.name.startswith("model.layers.0."))
    layer += 2 * a.hidden + (2 * a.head_dim if a.qk_norm else 0)
    root = a.vocab * a.hidden * (1 if a.tied else 2) + a.hidden
    return (root + layer) * wsize, (root + 2 * layer) * wsize


def estimate_memory(model_or_config, *, method: str, rank: int | None = None,
                    targets: Targets = None, batch: int | None = None,
                    seq_len: int | None = None, dtype: torch.dtype = torch.bfloat16,
                    chunk_rows: int | None = None, implementation: str = "torch",
                    compute_dtype: torch.dtype | None = None,
                    fsdp: int = 1, bf16_matmul_scratch: bool = False) -> MemoryEstimate:
    """Predict the memory of one training step of ``method`` on a model.

    Args:
        model_or_config: an ``nn.Module``, a config dict, or the path of a local Hugging Face
            ``config.json`` (or of its folder) of a Llama, Mistral, Qwen2, Qwen3 or GPT-2 model.
        method: one of :data:`METHODS`: 'rgc' (:class:`rgc.RGCOptimizer` on
            :func:`rgc.wrap`), 'rowadam' (RowAdam on the same wrapped layers),
            'rgc-momentum' (RGCOptimizer with ``momentum > 0``), 'lora' (peft
            LoRA on the same targets), 'galore', 'apollo', 'apollo-mini' (galore-torch and
            apollo-torch on the targets' weights), 'adamw' (dense, FP32 master copy), and the
            AdamW variants training every parameter in BF16: 'adamw-bf16' (torch), 'adamw-bf16-sr'
            (torchao ``_AdamW(bf16_stochastic_round=True)``), 'adamw8bit' and 'adamw4bit'
            (torchao), 'bnb-adamw8bit' (bitsandbytes).
        rank: r for the methods in :data:`RANKED` (APOLLO-Mini's is 1).
        targets: the layers compressed or adapted, as :func:`rgc.wrap` picks them
            (``None``: its ``DEFAULT_TARGETS``, i.e. q/k/v/o/gate/up/down for Llama-style
            models): :func:`rgc.targets.plan_targets` on the module, or, for a config, on the
            model built on the ``meta`` device (mixture-of-experts families) or on stand-ins
            (a ``meta``-device ``nn.Linear`` of each layer's shape, at its qualified name) for
            the families read from their numbers. A predicate gets ``(name, module)`` as in
            ``rgc.wrap``. GPT-2's ``Conv1D`` layers are never targets (rgc does not sketch
            them).
        batch, seq_len: give both to include saved activations (Llama-style models,
            Qwen3-MoE and Mixtral).
        dtype: the weights' dtype when reading a config (a module's own dtypes are used).
        chunk_rows: rows of H rebuilt at once by the reference RGC step (``None``: the
            optimizers' default, :func:`rgc.updates.default_chunk_rows`).
        implementation: 'torch' (reference step, chunk temporaries; bitsandbytes' CPU step)
            or 'triton' (GPU kernels: rgc's fused kernel stores no chunk of H, bitsandbytes'
            CUDA kernel updates in place).
        compute_dtype: ``torch.float32`` if the model runs under
            :func:`rgc.compute.use_compute_dtype` with low-precision weights: adds the
            transient FP32 copies of :func:`compute_copy_bytes` (``compute_copies``).
        fsdp: per-GPU memory under FSDP2 over this many GPUs (1: no sharding). Weights,
            gradients, master copy, optimizer state and adapters are divided by ``fsdp``
            (RowAdam's m and v live with the rows or experts each GPU owns:
            :class:`rgc.DistributedRowAdam`); rgc's sketches and projections are whole on
            every GPU; during forward and backward the root module's parameters (embedding,
            final norm, untied lm_head) are gathered, with one decoder layer when backward
            starts and two later (:func:`_fsdp_gathered`). Not for 'galore',
            'apollo' and 'apollo-mini', whose optimizers do not run on FSDP2's sharded
            parameters.
        bf16_matmul_scratch: the model runs on a CPU whose BF16 matmuls accumulate into an
            FP32 buffer of their output's size while they run
            (:func:`rgc.compute.bf16_matmul_scratch` tells for this machine: x86 with AVX-512
            but no BF16 instructions). With activations (``batch``/``seq_len``), backward
            start then peaks in the output layer's first matmul rather than in the loss: the
            activations less the BF16 logits (freed by then), that matmul's output and its
            FP32 buffer (``matmul_scratch``, :func:`matmul_scratch_bytes`); the other matmuls
            meet smaller transients (measured with the allocator's events,
            ``tests/test_memory_estimate.py``). Not with ``compute_dtype=torch.float32``,
            whose matmuls are FP32.

    Assumptions, per method (bytes per element in parentheses):

    * every method: the model weights as stored; all parameters outside the targets frozen
      (AdamW trains all). ``zero_grad(set_to_none=True)`` after each step, so gradients and
      sketches live from backward to the step.
    * rgc: per target C (d x r, 4) and P (k x r, weight dtype); no dense weight gradient and
      no tensor optimizer state; step temporaries per :func:`rgc_step_temporaries`, with P
      regenerated after every step (``refresh='every_step'``, the default of rgc.wrap). A
      rank that rgc.wrap's default orthonormal P cannot give (``rank`` > a target's
      ``in_features``) raises its ``ValueError``, as wrap would.
    * rowadam: rgc's, plus m (d x r, 4) and v (d, 4) per target (and AdamW moments for
      trainable biases); step temporaries per :func:`rowadam_step_temporaries`.
    * rgc-momentum: rgc's with ``momentum > 0``, plus the momentum buffer (d x r, 4) per
      target; step temporaries per :func:`momentum_step_temporaries`.
    * lora: peft-style A (r x k) and B (d x r) in FP32 per target, their FP32 gradients and two
      FP32 AdamW moments (16 bytes per adapter element); fused AdamW (no step temporaries).
    * adamw: the mixed-precision recipe of ``benchmarks/memory.py``: weights in ``dtype`` for
      forward and backward, an FP32 master copy, FP32 gradient buffers kept between steps
      (each BF16 gradient is added into them as soon as it is produced and then dropped), two
      FP32 moments, fused AdamW, then the master copy is written back: 16 bytes per parameter
      on top of the weights. At backward end the transient BF16 gradient of the largest
      parameter is added (three of them for a tied embedding: the lm_head's and the
      embedding's contributions and their sum); on expert stacks, the expert-backward
      transients of :func:`_plan_adamw`.
    * adamw-bf16, adamw-bf16-sr, adamw8bit, adamw4bit, bnb-adamw8bit: every parameter
      trained in its dtype; BF16 gradients from backward to ``zero_grad`` (a tied embedding
      adds its two contributions at backward end); two moments per parameter: in the
      parameter dtype (bf16 variants), or block-quantized for tensors of at least 4096
      elements (torchao 8-bit: 1 byte + an FP32 scale per 256; 4-bit: half a byte + an FP32
      scale per 128; smaller tensors in the parameter dtype; bitsandbytes 8-bit: as torchao's
      8-bit with FP32 states for small tensors); step temporaries per
      :data:`DENSE_STEP_TEMPORARIES` (none for the fused and compiled bf16 steps).
    * galore, apollo, apollo-mini: see :func:`_plan_projected`; activations as for a model
      whose targets' weights alone are trained (each linear saves its input).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    plan_of, ranked, targeted, shardable = _METHODS[method]
    if ranked and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(f"method {method!r} needs rank= a positive integer, got {rank!r}")
    if implementation not in ("torch", "triton"):
        raise ValueError(f"implementation must be 'torch' or 'triton', got {implementation!r}")
    if compute_dtype not in (None, torch.float32):
        raise ValueError(f"compute_dtype must be torch.float32 or None, got {compute_dtype}")
    if (batch is None) != (seq_len is None):
        raise ValueError("give both batch= and seq_len= (for activations), or neither")
    if not isinstance(fsdp, int) or fsdp < 1:
        raise ValueError(f"fsdp must be a GPU count >= 1, got {fsdp!r}")
    if fsdp > 1 and not shardable:
        raise ValueError(f"method {method!r} has no FSDP2 memory model: its optimizer "
                         "(galore-torch, apollo-torch) does not run on FSDP2's sharded "
                         "parameters; use fsdp=1")
    if isinstance(model_or_config, nn.Module):
        spec = spec_from_module(model_or_config)
    elif isinstance(model_or_config, (dict, str, os.PathLike)):
        spec = spec_from_config(model_or_config, dtype=dtype)
    else:
        raise TypeError("model_or_config must be an nn.Module, a config dict or the path of a "
                        f"config.json, got {type(model_or_config).__name__}")
    chosen = _chosen(model_or_config, spec, targets, dtype)
    if targeted and not chosen:
        raise ValueError(f"targets {targets!r} matched no linear layer of the model")
    if plan_of is _plan_sketch:  # rgc.wrap's default P (orthonormal) limits the rank
        check_rank("orthonormal", min(s.k for s in chosen), rank)
    plan = plan_of(spec, chosen, rank, method=method, chunk_rows=chunk_rows,
                   implementation=implementation)
    est = {"weights": spec.weight_bytes, **plan.parts}
    gathered_at_start = gathered = 0
    if fsdp > 1:
        est = {k: -(-v // fsdp) if k in _SHARDED else v for k, v in est.items()}
        gathered_at_start, gathered = _fsdp_gathered(spec)
    per_step = sum(est[k] for k in plan.per_step)
    phases = {"optimizer step": (per_step, plan.step_temp, 0),
              "backward end": (per_step, plan.end_temp + gathered, 0)}
    acts, loss_temp, head = plan.fixed_activations, 0, 0
    if batch is not None:
        if spec.arch is None:
            raise ValueError("activations are modelled for Llama-style decoders (Llama, "
                             "Mistral, Qwen2, Qwen3) and the mixture-of-experts families "
                             f"{MOE_ACTIVATION_FAMILIES}, given by a config or a transformers "
                             "model, not for this one; leave batch/seq_len unset for it (the "
                             "estimate is then everything but the batch's activations)")
        if spec.arch.moe_layers and plan.activations == "targets":
            raise ValueError(f"method {method!r} trains the targets' weights alone; its "
                             "activations are not modelled for mixture-of-experts layers: "
                             "leave batch/seq_len unset")
        saved, loss_temp, head = _activations(spec.arch, plan.activations, rank or 0,
                                              batch * seq_len, seq_len, spec.weight_itemsize,
                                              chosen)
        acts += saved
    if batch is not None or acts:
        est["activations"] = acts
        phases["backward start"] = (0, loss_temp + gathered_at_start, acts)
    if plan.backward_temp:
        # a bound: the last layer's own activations are partly freed by then
        phases["expert backward"] = (0, plan.backward_temp + gathered, acts - head)
    copies = scratch = 0
    head_layer = next((s for s in spec.linears if s.name == "lm_head"), None)
    if compute_dtype is not None and spec.weight_itemsize < FP32:
        copies = compute_copy_bytes(spec.linears, (batch or 0) * (seq_len or 0))
        phases = _with_compute_copies(phases, copies)
    elif (bf16_matmul_scratch and spec.weight_itemsize < FP32 and batch is not None
          and head_layer is not None):  # backward starts in the output layer's matmul
        n, wsize = batch * seq_len, spec.weight_itemsize
        dense = plan.activations == "dense"  # trains every weight, the output layer's too
        scratch = matmul_scratch_bytes(head_layer, n, dense)
        out = (head_layer.d if dense else n) * head_layer.k * wsize
        grads, temp, acts_live = phases["backward start"]
        in_head = gathered_at_start + out + scratch - n * head_layer.d * wsize
        phases["backward start"] = (grads, max(temp, in_head), acts_live)
    phase, (grads_live, temp, acts_live) = max(phases.items(), key=lambda kv: sum(kv[1]))
    at_peak = {k: 0 if (k in plan.per_step and not grads_live) else v
               for k, v in est.items() if k != "activations"}
    at_peak["activations"] = acts_live
    at_peak["temporaries"] = temp
    return MemoryEstimate(method=method, rank=rank if ranked else None, temporaries=temp,
                          compute_copies=copies, matmul_scratch=scratch,
                          total=sum(at_peak.values()), phase=phase,
                          at_peak=at_peak, **est)
