"""Predict training memory before training: :func:`estimate_memory`.

The model is described by its layer shapes (:class:`ModelSpec`), taken from an ``nn.Module``
or computed from the numbers of a Hugging Face ``config.json`` (Llama, Mistral, Qwen2, Qwen3,
GPT-2), with no network access and without building the model.

Peak model. One training step is forward, backward, optimizer step, then
``zero_grad(set_to_none=True)``. What a method keeps from step to step (weights, projections,
optimizer state, an FP32 master copy) is always live. On top of it the peak is the largest of
three moments:

* start of backward: every saved activation plus the loss's transient gradients;
* end of backward: all of this step's gradients (RGC's sketches, LoRA's adapter gradients;
  for AdamW, which keeps FP32 gradient buffers, the embedding's transient BF16 gradient);
* optimizer step: the gradients plus the step's largest temporaries.

The activation model is written for Llama-style decoders (Llama, Mistral, Qwen2, Qwen3) as
implemented by ``transformers`` with SDPA attention (a fused kernel saving out and logsumexp,
no n x n attention matrix), no padding mask, ``use_cache=False``, and the loss
``ForCausalLMLoss`` (FP32 upcast of the logits, log_softmax, NLL). It is exact, to the byte,
for the tensors autograd saves in that implementation (``tests/test_memory_estimate.py``
checks it against a measured forward).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import torch.nn as nn

from rgc.nn import DEFAULT_TARGETS

METHODS = ("rgc", "rowadam", "lora", "adamw")
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3")
FAMILIES = (*LLAMA_FAMILY, "gpt2")
FP32 = 4

#: Reference-path update, bytes per element of one ``chunk_rows x k`` chunk of H: the FP32
#: new rows (4) and the FP32 squares of the stored rows for ``||W_new||^2`` (4), or, while the
#: next chunk is built, the previous chunk's new rows (4); the BF16 result is rounded straight
#: into W. Measured with the tracker on torch 2.13;
#: ``tests/test_memory_estimate.py`` checks whole steps.
UPDATE_BYTES_PER_CHUNK_ELEMENT = 8

#: The step's device scalars of one layer (an FP32 coefficient and a bool flag, 0-dim, live
#: until its projection is refreshed), rounded up to two CUDA allocator blocks of 512 bytes.
UPDATE_SCALAR_BYTES = 1024


@dataclass(frozen=True)
class LinearShape:
    """One linear layer: qualified ``name``, weight ``d x k`` (out x in), ``bias``."""

    name: str
    d: int
    k: int
    bias: bool = False


@dataclass(frozen=True)
class Architecture:
    """The config numbers the activation model needs (Llama-style decoder)."""

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
    """

    weight_bytes: int
    num_params: int
    linears: tuple[LinearShape, ...]
    arch: Architecture | None = None
    weight_itemsize: int = 2
    largest_param: int = 0


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
        activations: tensors saved for backward at ``batch x seq_len`` (0 if not given).
        temporaries: the transient at the peak moment (loss gradients, step temporaries).
        compute_copies: with ``compute_dtype=torch.float32`` (:mod:`rgc.compute`), the largest
            transient of one upcast matmul, included in ``temporaries`` where it applies.

    ``total`` is the predicted peak; ``at_peak`` splits it into what is live at that moment
    (its values add up to ``total``); ``phase`` names the moment ('backward start',
    'backward end' or 'optimizer step'); ``state`` is the method's training state
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
    numel = sum(s.d * s.k + (s.d if s.bias else 0) for s in linears)
    norms = 2 * h + (2 * hd if family == "qwen3" else 0)
    numel += n_layers * norms + h + vocab * h * (1 if tied else 2)
    linears.append(LinearShape("lm_head", vocab, h))  # an nn.Linear even when tied
    # The rotary embedding's FP32 buffers inv_freq and original_inv_freq (transformers >= 5).
    inv_freq = 2 * (hd // 2) * FP32
    arch = Architecture(family, h, i, n_layers, heads, kv_heads, hd, vocab, tied,
                        qk_norm=family == "qwen3")
    return ModelSpec(numel * itemsize + inv_freq, numel, tuple(linears), arch, itemsize,
                     largest_param=max(vocab * h, i * h))


def _gpt2_spec(cfg: dict, itemsize: int) -> ModelSpec:
    h, n_layers, vocab = cfg["n_embd"], cfg["n_layer"], cfg["vocab_size"]
    inner = cfg.get("n_inner") or 4 * h
    per_layer = [("attn.c_attn", 3 * h, h), ("attn.c_proj", h, h), ("mlp.c_fc", inner, h),
                 ("mlp.c_proj", h, inner)]
    linears = [LinearShape(f"transformer.h.{n}.{name}", d, k, True)
               for n in range(n_layers) for name, d, k in per_layer]
    numel = sum(s.d * s.k + s.d for s in linears)
    numel += n_layers * 4 * h + 2 * h + vocab * h + cfg.get("n_positions", 1024) * h
    linears.append(LinearShape("lm_head", vocab, h))  # tied to the token embedding
    return ModelSpec(numel * itemsize, numel, tuple(linears), None, itemsize,
                     largest_param=max(vocab * h, inner * h))


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
    raise ValueError(f"unsupported model_type {family!r}; supported families: {FAMILIES}")


def spec_from_module(model: nn.Module) -> ModelSpec:
    """:class:`ModelSpec` of a built model (any dtype and device, ``meta`` included).

    Linear layers are ``nn.Linear`` (a wrapped ``CompressedLinear`` too) and transformers'
    ``Conv1D``. If the model has a ``config`` of a supported family, its numbers are used for
    the activation model.
    """
    seen: set = set()
    weight_bytes = numel = largest = 0
    for t in [*model.parameters(), *model.buffers()]:
        key = (t.device, t.untyped_storage().data_ptr()) if t.device.type != "meta" else id(t)
        if key in seen:
            continue
        seen.add(key)
        weight_bytes += t.numel() * t.element_size()
        if isinstance(t, nn.Parameter):
            numel += t.numel()
            largest = max(largest, t.numel())
    linears, itemsize = [], 2
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            linears.append(LinearShape(name, m.out_features, m.in_features, m.bias is not None))
            itemsize = m.weight.element_size()
        elif type(m).__name__ == "Conv1D" and getattr(m, "weight", None) is not None:
            k, d = m.weight.shape
            linears.append(LinearShape(name, d, k, getattr(m, "bias", None) is not None))
    arch = None
    cfg = getattr(model, "config", None)
    if cfg is not None and getattr(cfg, "model_type", None) in LLAMA_FAMILY:
        arch = _llama_spec(cfg.to_dict(), cfg.model_type, itemsize).arch
    return ModelSpec(weight_bytes, numel, tuple(linears), arch, itemsize, largest)


# -- estimate -----------------------------------------------------------------------------

def _is_target(targets, name: str) -> bool:
    if targets is None:
        return name.rsplit(".", 1)[-1] in DEFAULT_TARGETS
    if callable(targets):
        return bool(targets(name, None))
    return name in targets or name.rsplit(".", 1)[-1] in targets


def _activations(arch: Architecture, method: str, rank: int, n: int, seq_len: int,
                 wsize: int, targets: list[LinearShape]) -> tuple[int, int]:
    """(saved activations, loss transient at backward start) in bytes for n tokens.

    Per decoder layer (h hidden, i intermediate, q = heads * head_dim, c = kv_heads * head_dim,
    a heads, g kv heads; BF16 = 2 bytes, FP32 = 4), what autograd saves:

    * each RMSNorm: its FP32 input (4nh) and 1/rms (4n); AdamW also the normalised BF16 tensor
      (2nh) for the norm weight's gradient and the norm's output (2nh) for the next linear's;
      Qwen3's q/k norms the same on q and c with a and g rows;
    * attention (SDPA): q and its output (2nq each), k and v (2nc each), FP32 logsumexp (4na);
    * MLP: gate and up outputs and SiLU(gate) (3 x 2ni); AdamW also SiLU(gate)*up (2ni);
    * per target linear: RGC/RowAdam ``X P`` (n x r, weight dtype); LoRA the FP32 copy of its
      input (4nk, one per target: peft casts x for each adapter) and ``A x`` (4nr).

    The terms other than the targets' assume at least one target in the attention and one in
    the MLP of every layer (the default targets are all seven projections).

    The first layer's input norm saves nothing unless the embedding is trained (AdamW).
    Model level: the embedding's int64 ids (AdamW), RoPE cos and sin (2 x seq x head_dim,
    shared by all layers), the final norm, the FP32 log_softmax of the logits (4nV) and the
    int64 targets. The loss transient at backward start is the NLL and log_softmax input
    gradients, 2 x 4nV.
    """
    h, i, q = arch.hidden, arch.intermediate, arch.heads * arch.head_dim
    c, a, g, V = arch.kv_heads * arch.head_dim, arch.heads, arch.kv_heads, arch.vocab
    dense = method == "adamw"
    norm = 4 * n * h + 4 * n + (4 * n * h if dense else 0)
    qk = 0
    if arch.qk_norm:
        qk = 4 * n * (q + c) + 4 * n * (a + g) + (2 * n * (q + c) if dense else 0)
    attention = 2 * n * (2 * q + 2 * c) + 4 * n * a
    mlp = 6 * n * i + (2 * n * i if dense else 0)
    if method in ("rgc", "rowadam"):
        saved_by_targets = len(targets) * n * rank * wsize
    elif method == "lora":
        saved_by_targets = sum(4 * n * s.k + 4 * n * rank for s in targets)
    else:
        saved_by_targets = 0
    total = arch.layers * (2 * norm + qk + attention + mlp) + saved_by_targets
    if not dense:
        total -= 4 * n * h + 4 * n  # the first layer's input norm
    total += 8 * n if dense else 0  # embedding ids
    total += 2 * seq_len * arch.head_dim * wsize  # cos, sin
    total += 4 * n * h + 4 * n + (4 * n * h if dense else 0)  # final norm
    total += 4 * n * V + 8 * n + FP32  # log_softmax, targets, loss
    return total, 2 * 4 * n * V


def _refresh_temp(k: int, r: int, weight_itemsize: int = 2) -> int:
    # rgc.projection, measured: G (4k * 2ceil(r/2)) and G R^-1 (4kr) beside the r x r factors
    # (BF16 P, k >= 4r); G, its float64 copy and G R^-1 (FP32 P); float64 CholeskyQR3 (k < 4r).
    if k < 4 * r:
        return 20 * k * r + 16 * r * r + 8
    if weight_itemsize == 2:
        return 8 * k * ((r + 1) // 2) + 4 * k * r + 4 * r * r
    return 16 * k * r + 12 * r * r


def _update_temp(d: int, k: int, r: int, chunk_rows: int, implementation: str) -> int:
    # an FP32 copy of P plus the chunk of H and the scaled chunk of C (none on the Triton kernel)
    if implementation == "triton":
        return 4 * k * r
    return 4 * k * r + min(chunk_rows, d) * (k * UPDATE_BYTES_PER_CHUNK_ELEMENT + 4 * r)


def rgc_step_temporaries(d: int, k: int, r: int, *, chunk_rows: int = 128,
                         implementation: str = "torch", weight_itemsize: int = 2) -> int:
    """Largest transient of one RGCOptimizer update of a d x k weight at rank r, in bytes.

    The largest of: the finiteness check of C (7dr); ``||H||`` from the Gram matrix (an FP32
    copy of P, C P^T P and its product with C: 4kr + 8dr + 4r^2); ``||W||`` over row chunks
    (8 bytes per chunk element); the update (4kr plus
    :data:`UPDATE_BYTES_PER_CHUNK_ELEMENT` per chunk element); regenerating P after the step
    (about 8kr for BF16 weights, 16kr for FP32, 20kr when k < 4r).
    """
    return UPDATE_SCALAR_BYTES + max(
        7 * d * r, 4 * k * r + 8 * d * r + 4 * r * r, 8 * min(chunk_rows, d) * k,
        _update_temp(d, k, r, chunk_rows, implementation), _refresh_temp(k, r, weight_itemsize))


def rowadam_step_temporaries(d: int, k: int, r: int, *, chunk_rows: int = 128,
                             implementation: str = "torch", weight_itemsize: int = 2) -> int:
    """Largest transient of one RowAdam update of a d x k weight at rank r, in bytes.

    The finiteness check (7dr); then the direction U (4dr) stays live while the update runs
    (as RGC's) and while, with a copy of the old P (2kr), P is regenerated (as RGC's) and m is
    carried into the new basis (float64 copies of both P and r x r products, 16kr + 16r^2,
    then the new m beside the old float64 P, 8kr + 12r^2 + 4dr).
    """
    carry = max(16 * k * r + 16 * r * r, 8 * k * r + 12 * r * r + 4 * d * r)
    return UPDATE_SCALAR_BYTES + max(
        7 * d * r, 4 * d * r + max(_update_temp(d, k, r, chunk_rows, implementation),
                                   2 * k * r + max(_refresh_temp(k, r, weight_itemsize), carry)))


# -- compute mode (rgc.compute): FP32 matmuls on low-precision weights ----------------------

def compute_copy_bytes(linears: Iterable[LinearShape], n_tokens: int = 0) -> int:
    """Largest transient of one FP32-computed linear layer on ``n_tokens`` tokens, in bytes.

    Under :func:`rgc.compute.use_compute_dtype` each matmul of a d x k linear layer (targets
    and the others, e.g. lm_head) makes FP32 copies of its weight (4dk) and input (4nk) and an
    FP32 result (4nd) that live until it returns; the input-gradient matmul of backward has
    the same sizes. Attention run by SDPA is not upcast and adds nothing.
    """
    return max((4 * (s.d * s.k + n_tokens * s.k + n_tokens * s.d) for s in linears), default=0)


def _with_compute_copies(phases: dict, copies: int) -> dict:
    """Add ``copies`` to the transient of the phases in which the model's matmuls run.

    A bound: the largest copy is assumed to coincide with the loss transient at backward
    start and with the end-of-backward transient (the optimizer step computes in FP32 anyway).
    """
    return {name: (grads, temp + copies, acts) if name != "optimizer step" else (grads, temp,
                                                                                   acts)
            for name, (grads, temp, acts) in phases.items()}


def estimate_memory(model_or_config, *, method: str, rank: int | None = None,
                    targets: Iterable[str] | Callable | None = None, batch: int | None = None,
                    seq_len: int | None = None, dtype: torch.dtype = torch.bfloat16,
                    chunk_rows: int = 128, implementation: str = "torch",
                    compute_dtype: torch.dtype | None = None) -> MemoryEstimate:
    """Predict the memory of one training step of ``method`` on a model.

    Args:
        model_or_config: an ``nn.Module``, a config dict, or the path of a local Hugging Face
            ``config.json`` (or of its folder) of a Llama, Mistral, Qwen2, Qwen3 or GPT-2 model.
        method: 'rgc' (:class:`rgc.RGCOptimizer` on :func:`rgc.wrap`), 'rowadam' (RowAdam on
            the same wrapped layers), 'lora' (peft LoRA on the same targets), or 'adamw' (dense).
        rank: r for 'rgc', 'rowadam' and 'lora'.
        targets: the layers compressed or adapted, as in :func:`rgc.wrap` (``None``: its
            ``DEFAULT_TARGETS``, i.e. q/k/v/o/gate/up/down for Llama-style models).
        batch, seq_len: give both to include saved activations (Llama-style models only).
        dtype: the weights' dtype when reading a config (a module's own dtypes are used).
        chunk_rows: rows of H rebuilt at once by the reference RGC step.
        implementation: 'torch' (reference step, chunk temporaries) or 'triton' (fused kernel,
            no chunk of H is stored).
        compute_dtype: ``torch.float32`` if the model runs under
            :func:`rgc.compute.use_compute_dtype` with low-precision weights: adds the
            transient FP32 copies of :func:`compute_copy_bytes` (``compute_copies``).

    Assumptions, per method (bytes per element in parentheses):

    * every method: the model weights as stored; all parameters outside the targets frozen
      (AdamW trains all). ``zero_grad(set_to_none=True)`` after each step, so gradients and
      sketches live from backward to the step.
    * rgc: per target C (d x r, 4) and P (k x r, weight dtype); no dense weight gradient and
      no tensor optimizer state; step temporaries per :func:`rgc_step_temporaries`, with P
      regenerated after every step (``refresh='every_step'``, the default of rgc.wrap).
    * rowadam: rgc's, plus m (d x r, 4) and v (d, 4) per target (and AdamW moments for
      trainable biases); step temporaries per :func:`rowadam_step_temporaries`.
    * lora: peft-style A (r x k) and B (d x r) in FP32 per target, their FP32 gradients and two
      FP32 AdamW moments (16 bytes per adapter element); fused AdamW (no step temporaries).
    * adamw: the mixed-precision recipe of ``benchmarks/memory.py``: weights in ``dtype`` for
      forward and backward, an FP32 master copy, FP32 gradient buffers kept between steps
      (each BF16 gradient is added into them as soon as it is produced and then dropped), two
      FP32 moments, fused AdamW, then the master copy is written back: 16 bytes per parameter
      on top of the weights. At backward end the transient BF16 gradient of the largest
      parameter is added (three of them for a tied embedding: the lm_head's and the
      embedding's contributions and their sum).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if method != "adamw" and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 1):
        raise ValueError(f"method {method!r} needs rank= a positive integer, got {rank!r}")
    if implementation not in ("torch", "triton"):
        raise ValueError(f"implementation must be 'torch' or 'triton', got {implementation!r}")
    if compute_dtype not in (None, torch.float32):
        raise ValueError(f"compute_dtype must be torch.float32 or None, got {compute_dtype}")
    if (batch is None) != (seq_len is None):
        raise ValueError("give both batch= and seq_len= (for activations), or neither")
    if isinstance(model_or_config, nn.Module):
        spec = spec_from_module(model_or_config)
    elif isinstance(model_or_config, (dict, str, os.PathLike)):
        spec = spec_from_config(model_or_config, dtype=dtype)
    else:
        raise TypeError("model_or_config must be an nn.Module, a config dict or the path of a "
                        f"config.json, got {type(model_or_config).__name__}")
    chosen = [s for s in spec.linears if _is_target(targets, s.name)]
    if method != "adamw" and not chosen:
        raise ValueError(f"targets {targets!r} matched no linear layer of the model")
    wsize = spec.weight_itemsize
    est = {"weights": spec.weight_bytes}
    per_step = 0  # allocated in backward, freed by zero_grad
    step_temp = 0
    if method in ("rgc", "rowadam"):
        est["sketch"] = sum(s.d * rank * FP32 for s in chosen)
        est["projections"] = sum(s.k * rank * wsize for s in chosen)
        est["optimizer_state"] = 0  # RGCOptimizer keeps Python ints only
        # Trainable biases of the targets keep a dense gradient.
        est["gradients"] = sum(s.d * wsize for s in chosen if s.bias)
        per_step = est["sketch"] + est["gradients"]
        temps = rgc_step_temporaries if method == "rgc" else rowadam_step_temporaries
        step_temp = max(temps(s.d, s.k, rank, chunk_rows=chunk_rows,
                              implementation=implementation, weight_itemsize=wsize)
                        for s in chosen)
        if method == "rowadam":
            est["optimizer_state"] = sum(s.d * rank * FP32 + s.d * FP32 for s in chosen)
            # elementwise AdamW moments of the targets' trainable biases
            est["optimizer_state"] += sum(2 * s.d * FP32 for s in chosen if s.bias)
    elif method == "lora":
        adapter = sum(rank * (s.d + s.k) for s in chosen)
        est["adapters"] = adapter * FP32
        est["gradients"] = adapter * FP32
        est["optimizer_state"] = 2 * adapter * FP32
        per_step = est["gradients"]
    else:
        est["master"] = spec.num_params * FP32
        est["gradients"] = spec.num_params * FP32
        est["optimizer_state"] = 2 * spec.num_params * FP32
    # AdamW: the BF16 gradient of the largest parameter (the embedding) before the hook adds
    # it into its FP32 buffer. A tied embedding gets two contributions, the lm_head's (held by
    # autograd from the start of backward) and the embedding's, which autograd sums before
    # accumulating: three V x h tensors at the end of backward.
    end_temp = 0
    if method == "adamw":
        tied = spec.arch is not None and spec.arch.tied
        end_temp = (3 if tied else 1) * spec.largest_param * wsize
    phases = {"optimizer step": (per_step, step_temp, 0),
              "backward end": (per_step, end_temp, 0)}
    if batch is not None:
        if spec.arch is None:
            raise ValueError("activations are modelled for Llama-style decoders (Llama, "
                             "Mistral, Qwen2, Qwen3) given by a config or a transformers model; "
                             "leave batch/seq_len unset for this model")
        acts, loss_temp = _activations(spec.arch, method, rank or 0, batch * seq_len,
                                       seq_len, wsize, chosen)
        est["activations"] = acts
        phases["backward start"] = (0, loss_temp, acts)
    copies = 0
    if compute_dtype is not None and wsize < FP32:
        copies = compute_copy_bytes(spec.linears, (batch or 0) * (seq_len or 0))
        phases = _with_compute_copies(phases, copies)
    phase, (grads_live, temp, acts_live) = max(phases.items(), key=lambda kv: sum(kv[1]))
    transient = {"rgc": ("sketch", "gradients"), "rowadam": ("sketch", "gradients"),
                 "lora": ("gradients",), "adamw": ()}[method]
    at_peak = {k: 0 if (k in transient and not grads_live) else v
               for k, v in est.items() if k != "activations"}
    at_peak["activations"] = acts_live
    at_peak["temporaries"] = temp
    return MemoryEstimate(method=method, rank=None if method == "adamw" else rank,
                          temporaries=temp, compute_copies=copies,
                          total=sum(at_peak.values()), phase=phase,
                          at_peak=at_peak, **est)
