"""Every mixture-of-experts model type of the installed transformers, built tiny.

:func:`moe_model_types` enumerates them from transformers itself: the model types whose modeling
module defines an Experts class with transformers' experts interface
(``@use_experts_implementation``) and whose config counts experts. :func:`decoder_type` maps a
composite (vision-language, omni) model type to the text model type holding its experts;
:func:`tiny_model` builds that text model from the default config shrunk by :func:`tiny_config`
(2 layers, hidden 32, 4 experts of width 16, 2 per token, vocabulary 64) and the per-family
numbers of :data:`OVERRIDES`.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import pathlib

import torch

EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")

#: The shared tiny numbers, set where the config has the attribute.
SIZES = dict(hidden_size=32, intermediate_size=32, moe_intermediate_size=16,
             shared_expert_intermediate_size=16, num_hidden_layers=2, num_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=64,
             max_position_embeddings=64, num_experts=4, num_local_experts=4, n_routed_experts=4,
             moe_num_experts=4, num_experts_per_tok=2, top_k_experts=2, num_experts_per_token=2,
             moe_k=2, moe_topk=2, first_k_dense_replace=1, kv_lora_rank=8, q_lora_rank=16,
             qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, n_group=1, topk_group=1,
             num_expert_group=1, sliding_window=16, linear_head_dim=8, linear_num_heads=4,
             linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
             linear_value_head_dim=8, index_head_dim=8, index_n_heads=2, index_topk=4)

#: Per model type: the numbers the shared ones do not cover (config names of each family).
OVERRIDES = {
    "deepseek_ocr2_text": dict(mlp_layer_types=["dense", "sparse"]),
    "dots1": dict(n_shared_experts=1),
    "dots3_note_text": dict(head_dim=12),
    "ernie4_5_moe": dict(moe_layer_start_index=1, moe_layer_end_index=1),
    "ernie4_5_vl_moe_text": dict(moe_intermediate_size=[16, 16], rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[1, 1, 2])),
    "flint": dict(mlp_only_layers=[0]),
    "gemma4_text": dict(enable_moe_block=True, vocab_size_per_layer_input=64),
    "glm5_next_text": dict(index_kpool=2, qk_rope_head_dim=0, head_dim=0, qk_head_dim=8),
    "glm4v_moe_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                partial_rotary_factor=0.5,
                                                mrope_section=[1, 1, 0])),
    "hy_v4_vl_text": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                               mrope_section=[1, 1, 0])),
    **{t: dict(swa_num_attention_heads=4, swa_num_key_value_heads=2, swa_head_dim=8)
       for t in ("inkling_text", "inkling2_text", "inkling2_loop_text")},
    "jamba": dict(attn_layer_period=2, attn_layer_offset=0, expert_layer_period=2,
                  expert_layer_offset=1, use_mamba_kernels=False, mamba_dt_rank=8),
    "kolibri1_1": dict(head_dim=16, mlp_only_layers=[0], index_layers=[1],
                       kv_source_layers=[0, 1], index_num_heads=2),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mistral4": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                          llama_4_scaling_beta=0.1,
                                          original_max_position_embeddings=64)),
    "nemotron_h": dict(mamba_num_heads=4, mamba_head_dim=8, n_groups=1),
    "qwen3_omni_moe_talker_text": dict(shared_expert_intermediate_size=16),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=8,
                           indexer_budget=4, indexer_compress_ratio=2),
    "zaya": dict(num_experts_per_tok=1),
}

#: Model types left out, with the reason.
SKIPPED = {
    "dots3_note_vision_encoder": "a vision encoder (image patches and their grid in, no token "
                                 "ids); its experts are the text model's kind of Experts module",
}


def _models_dir() -> pathlib.Path:
    import transformers

    return pathlib.Path(transformers.__file__).parent / "models"


def _module_name(model_type: str) -> str:
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    return model_type_to_module_name(model_type)


def _counts_experts(d: dict) -> bool:
    return any(k in EXPERT_COUNTS or (isinstance(v, dict) and _counts_experts(v))
               for k, v in d.items())


@functools.cache
def moe_model_types() -> tuple[str, ...]:
    """Model types whose modeling module uses transformers' experts interface and whose
    default config (or a sub-config) has an expert count."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    found = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        folder = _models_dir() / _module_name(model_type)
        source = "".join(p.read_text() for p in folder.glob("modeling_*.py"))
        if "@use_experts_implementation" in source and _counts_experts(
                AutoConfig.for_model(model_type).to_dict()):
            found.append(model_type)
    return tuple(found)


def decoder_type(model_type: str) -> str:
    """The model type of the text model of ``model_type`` (itself for a text model)."""
    from transformers import AutoConfig

    return AutoConfig.for_model(model_type).get_text_config().model_type


@functools.cache
def decoder_types() -> tuple[str, ...]:
    """The distinct text model types of :func:`moe_model_types`, in order."""
    return tuple(dict.fromkeys(decoder_type(t) for t in moe_model_types()))


def _two_layers(values: list) -> list:
    """Two entries of a per-layer list, of two different kinds where it has two."""
    kinds = list(dict.fromkeys(map(str, values)))
    firsts = [values[[str(v) for v in values].index(k)] for k in kinds]
    return (firsts + values)[:2]


def tiny_config(model_type: str):
    """The default config of ``model_type`` shrunk to the tiny numbers (see the module doc)."""
    from transformers import AutoConfig

    default = AutoConfig.for_model(model_type).to_dict()
    layers = default.get("num_hidden_layers", default.get("num_layers"))
    numbers = {k: v for k, v in SIZES.items() if k in default}
    if "kv_lora_rank" in default:  # multi-head latent attention: its rotary dims are head_dim
        numbers.update(head_dim=4, qk_head_dim=12, num_key_value_heads=4)
    for key, value in default.items():
        if (key in numbers or key in OVERRIDES.get(model_type, {}) or isinstance(value, bool)
                or key.endswith("token_id")):
            continue
        if isinstance(value, list) and layers and len(value) == layers:
            numbers[key] = _two_layers(value)
        elif isinstance(value, int) and value > 64:
            numbers[key] = 16
    if "per_layer_config" in default:
        numbers["per_layer_config"] = {}
    numbers.update(OVERRIDES.get(model_type, {}))
    numbers.update(pad_token_id=0, bos_token_id=0, eos_token_id=0)
    return AutoConfig.for_model(model_type, **numbers)


def model_class(model_type: str, config):
    """The causal LM of ``model_type`` (its base model where it has none)."""
    from transformers import PreTrainedModel
    from transformers.models.auto.modeling_auto import (
        MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        MODEL_MAPPING_NAMES,
    )

    name = _module_name(model_type)
    module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    mapped = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) or MODEL_MAPPING_NAMES.get(
        model_type)
    if mapped and hasattr(module, mapped) and getattr(module, mapped).config_class is type(
            config):
        return getattr(module, mapped)
    classes = [c for c in vars(module).values() if inspect.isclass(c)
               and issubclass(c, PreTrainedModel) and c.config_class is type(config)]
    classes.sort(key=lambda c: (not c.__name__.endswith("ForCausalLM"),
                                not c.__name__.endswith("Model"), c.__name__))
    if not classes:
        raise LookupError(f"no model class for {model_type!r} in {module.__name__}")
    return classes[0]


#: Text model types whose init leaves the expert weights as allocated (``torch.empty``):
#: Qwen3-Omni's talker built on its own. They are drawn from N(0, 0.02^2) here.
UNINITIALISED_EXPERTS = frozenset({"qwen3_omni_moe_talker_text"})


def tiny_model(model_type: str, seed: int = 0) -> torch.nn.Module:
    """The tiny FP32 model of text model type ``model_type``, in eval mode."""
    config = tiny_config(model_type)
    cls = model_class(model_type, config)
    torch.manual_seed(seed)
    model = cls(config).float().eval()
    if model_type in UNINITIALISED_EXPERTS:
        with torch.no_grad():
            for p in model.parameters():
                if p.dim() == 3:
                    p.normal_(0, 0.02)
    return model


#: Text model types fed embeddings instead of token ids: Qwen3-Omni's talker embeds its
#: codec tokens with ``codec_embedding``, and its forward on ``input_ids`` reads an
#: ``embed_tokens`` it does not have.
EMBEDDINGS_IN = frozenset({"qwen3_omni_moe_talker_text"})


def run(model_type: str, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The training forward on token ``ids`` [batch, seq] (no cache): logits of a causal LM,
    the last hidden state of a base model (from fixed random embeddings for
    :data:`EMBEDDINGS_IN`)."""
    if model_type in EMBEDDINGS_IN:
        hidden = model.config.hidden_size
        embeds = torch.randn(*ids.shape, hidden, generator=torch.Generator().manual_seed(0))
        out = model(inputs_embeds=embeds, use_cache=False)
    else:
        out = model(input_ids=ids, use_cache=False)
    logits = getattr(out, "logits", None)
    return logits if logits is not None else out.last_hidden_state
