"""rgc.wrap on every mixture-of-experts model type of the installed transformers.

For each text model type (:func:`tests.moe_zoo.decoder_types`), a tiny FP32 model: wrapped with
the default targets, its training forward (grad on) equals the unwrapped model's with the same
weights (relative Frobenius error <= 1e-5: the sketched experts forward sums a token's experts
in another order than the config's implementation), three RGCOptimizer steps move every
sketched weight and leave the rest, the routers are found and frozen, and the state dict, saved
and loaded into the unwrapped model, gives the weights bit for bit.
"""

import copy
import io
import warnings

import pytest
import torch

import rgc
from rgc.experts import SketchedExperts, expert_weight_names
from tests import moe_zoo

transformers = pytest.importorskip("transformers")

#: Families whose Experts class overrides the forward of transformers' experts interface: rgc
#: leaves their experts frozen, with a warning naming them.
OWN_EXPERTS_FORWARD = {"ergo": "ErgoExperts"}

TOLERANCE = 1e-5


def test_the_list_covers_every_moe_model_type():
    types = moe_zoo.moe_model_types()
    assert len(types) >= 90, types  # 96 in transformers 5.25
    for model_type in types:
        decoder = moe_zoo.decoder_type(model_type)
        assert decoder in moe_zoo.decoder_types() and decoder in moe_zoo.moe_model_types(), (
            model_type, decoder)
    tiny = set(moe_zoo.SKIPPED) | set(moe_zoo.OVERRIDES) | moe_zoo.EMBEDDINGS_IN
    assert tiny | moe_zoo.UNINITIALISED_EXPERTS <= set(moe_zoo.decoder_types())


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.slow
@pytest.mark.parametrize("model_type", moe_zoo.decoder_types())
def test_wrap_train_and_round_trip(model_type):
    if model_type in moe_zoo.SKIPPED:
        pytest.skip(moe_zoo.SKIPPED[model_type])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = moe_zoo.tiny_model(model_type)
    plain = copy.deepcopy(model)
    experts = [(n, m) for n, m in model.named_modules() if expert_weight_names(m) is not None]
    assert experts, f"{model_type}: no Experts module in the tiny model"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rgc.wrap(model, rank=2)
    messages = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    own = OWN_EXPERTS_FORWARD.get(model_type)
    for name, module in experts:
        if own is None:
            assert isinstance(module, SketchedExperts), name
        else:
            assert not isinstance(module, SketchedExperts), name
            assert any(own in m and "overrides the forward" in m for m in messages), messages
            assert not any(getattr(module, w).requires_grad for w in expert_weight_names(module))
    routers = rgc.router_parameters(model)
    assert routers and not any(p.requires_grad for _, p in routers), model_type

    ids = torch.randint(0, model.config.vocab_size, (2, 6),
                        generator=torch.Generator().manual_seed(0))
    wrapped_out = moe_zoo.run(model_type, model, ids)
    plain_out = moe_zoo.run(model_type, plain, ids)
    assert relative_error(wrapped_out, plain_out) <= TOLERANCE

    sketched = rgc.sketched_weights(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = rgc.RGCOptimizer([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for step in range(3):
        out = wrapped_out if step == 0 else moe_zoo.run(model_type, model, ids)
        out.float().square().mean().backward()
        reached = {n for n, o in sketched if o.sketch is not None and o.sketch.any()}
        optimizer.step()
        optimizer.zero_grad()
    after = dict(model.named_parameters())
    moved = {n for n, p in after.items() if not torch.equal(p, before[n])}
    trainable = {n for n, p in after.items() if p.requires_grad}
    # the weights the last backward reached (a nonzero sketch) move, a stack of experts only
    # some of whose experts saw tokens too; others (a sparse-attention indexer's wk, read
    # through a top-k; Ernie's vision experts on text) keep their bits
    assert reached <= moved <= trainable
    assert own is not None or any(o.num_matrices > 1 for n, o in sketched if n in reached)

    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    buffer.seek(0)
    plain.load_state_dict(torch.load(buffer, weights_only=True))
    state = plain.state_dict()
    assert list(state) == list(model.state_dict())
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    with torch.no_grad():
        assert torch.equal(moe_zoo.run(model_type, model, ids),
                           moe_zoo.run(model_type, plain, ids))
