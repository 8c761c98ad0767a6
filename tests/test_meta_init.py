"""Models built on the meta device, wrapped there, then materialised: rgc makes every buffer it
added (projections, sketch slots) from its seed when the module is materialised, so training
equals a model wrapped on the CPU bit for bit, and nothing uninitialised is ever read."""

from __future__ import annotations

import pytest
import torch

import rgc
from tests.models import TinyBlockLM, tiny_moe

STEPS = 3


def _batches(vocab: int) -> list[torch.Tensor]:
    return [torch.randint(0, vocab, (2, 7), generator=torch.Generator().manual_seed(i))
            for i in range(STEPS)]


def _build(kind: str, device: str):
    with torch.device(device):
        if kind == "dense":
            return TinyBlockLM(dtype=torch.bfloat16)
        return tiny_moe("qwen3_moe", dtype=torch.bfloat16, layers=1)


def _loss(kind: str, model, ids: torch.Tensor) -> torch.Tensor:
    if kind == "dense":
        logits = model(ids)
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                                 ids[:, 1:].flatten())
    return model(input_ids=ids, labels=ids).loss


def _train(kind: str, model, opt_cls) -> dict[str, torch.Tensor]:
    opt = opt_cls(model.parameters(), lr=1e-2, seed=1)
    vocab = 32 if kind == "dense" else 64
    for ids in _batches(vocab):
        _loss(kind, model, ids).backward()
        opt.step()
        opt.zero_grad()
    assert opt.skipped_updates() == 0
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("opt_cls", [rgc.RGCOptimizer, rgc.RowAdam])
@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_meta_wrapped_model_trains_like_one_wrapped_on_the_cpu(kind, opt_cls):
    torch.manual_seed(0)
    reference = _build(kind, "cpu")
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    # the model's own non-persistent buffers (rotary frequencies): the user's init makes them
    own_buffers = {k: v.clone() for k, v in reference.named_buffers() if k not in weights}
    rgc.wrap(reference, rank=4, seed=7)

    model = _build(kind, "meta")
    rgc.wrap(model, rank=4, seed=7)
    model.to_empty(device="cpu")
    model.load_state_dict(weights)
    with torch.no_grad():
        for k, v in own_buffers.items():
            model.get_buffer(k).copy_(v)
    for (name, a), (_, b) in zip(rgc.sketched_weights(reference), rgc.sketched_weights(model),
                                 strict=True):
        assert torch.equal(a.projection, b.projection), name
    want, got = _train(kind, reference, opt_cls), _train(kind, model, opt_cls)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_weights_assigned_to_a_meta_wrapped_model_get_projections_at_the_first_forward():
    torch.manual_seed(0)
    reference = _build("dense", "cpu")
    weights = {k: v.clone() for k, v in reference.state_dict().items()}
    rgc.wrap(reference, rank=4, seed=7)
    model = _build("dense", "meta")
    rgc.wrap(model, rank=4, seed=7)
    model.load_state_dict(weights, assign=True)
    assert all(layer.projection.is_meta for _, layer in rgc.compressed_layers(model))
    want, got = _train("dense", reference, rgc.RGCOptimizer), _train("dense", model,
                                                                      rgc.RGCOptimizer)
    for k, v in want.items():
        assert torch.equal(got[k], v), k
    for (name, a), (_, b) in zip(rgc.compressed_layers(reference), rgc.compressed_layers(model),
                                 strict=True):
        assert torch.equal(a.projection, b.projection), name


def test_the_registry_lets_torch_swap_parameters():
    """nn.Module._apply with swap_tensors (FSDP2's path, and torch's opt-in for .to()): no weak
    reference on a weight blocks it, and the optimizer still finds the swapped weights."""
    model = rgc.wrap(_build("dense", "cpu"), rank=4, seed=7)
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.float()
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    for name, layer in rgc.compressed_layers(model):
        assert rgc.registry.sketched_owner_of(layer.weight) is layer, name
        assert layer.projection.dtype == torch.float32
    _train("dense", model, rgc.RGCOptimizer)
