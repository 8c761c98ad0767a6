import pytest
import torch
import torch.nn as nn

import rgc
from rgc import CompressedLinear
from tests.models import TinyBlockLM, tiny_qwen3

PROJ_NAMES = {"q_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_default_targets_and_freezing():
    model = rgc.wrap(TinyBlockLM(), rank=4)
    names = [n for n, _ in rgc.compressed_layers(model)]
    assert {n.rsplit(".", 1)[-1] for n in names} == PROJ_NAMES and len(names) == 10
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable == {n + ".weight" for n in names}
    assert isinstance(model.lm_head, nn.Linear) and not isinstance(model.lm_head, CompressedLinear)


def test_list_and_predicate_targets_and_unfrozen_others():
    model = rgc.wrap(TinyBlockLM(), rank=4, targets=["blocks.0.q_proj", "lm_head"],
                     freeze_others=False)
    assert [n for n, _ in rgc.compressed_layers(model)] == ["blocks.0.q_proj", "lm_head"]
    assert all(p.requires_grad for p in model.parameters())
    model = rgc.wrap(TinyBlockLM(), rank=4, targets=lambda name, m: name.endswith("up_proj"))
    assert len(rgc.compressed_layers(model)) == 2


def test_layer_seeds_differ_and_are_reproducible():
    a = rgc.wrap(TinyBlockLM(), rank=4, seed=3)
    b = rgc.wrap(TinyBlockLM(), rank=4, seed=3)
    seeds_a = [m.seed for _, m in rgc.compressed_layers(a)]
    assert seeds_a == [m.seed for _, m in rgc.compressed_layers(b)]
    assert len(set(seeds_a)) == len(seeds_a)
    for (_, la), (_, lb) in zip(rgc.compressed_layers(a), rgc.compressed_layers(b)):
        assert torch.equal(la.projection, lb.projection)


def test_state_dict_loads_into_plain_model_and_unwrap_restores_linear():
    torch.manual_seed(0)
    plain = TinyBlockLM()
    wrapped = rgc.wrap(TinyBlockLM(), rank=4)
    with torch.no_grad():
        for p in wrapped.parameters():
            p.add_(1.0)
    sd = wrapped.state_dict()
    assert set(sd) == set(plain.state_dict())
    plain.load_state_dict(sd)
    original_weight = wrapped.blocks[0].q_proj.weight
    rgc.unwrap(wrapped)
    assert not rgc.compressed_layers(wrapped)
    assert type(wrapped.blocks[0].q_proj) is nn.Linear
    assert wrapped.blocks[0].q_proj.weight is original_weight
    ids = torch.randint(0, 32, (2, 5))
    torch.testing.assert_close(wrapped(ids), plain(ids))


def test_qwen3_wrap_and_save_pretrained_keys(tmp_path):
    model = tiny_qwen3()
    expected = set(model.state_dict())
    rgc.wrap(model, rank=4)
    assert len(rgc.compressed_layers(model)) == 2 * 7
    assert set(model.state_dict()) == expected
    model.save_pretrained(tmp_path)
    from transformers import Qwen3ForCausalLM

    reloaded = Qwen3ForCausalLM.from_pretrained(tmp_path)
    assert not rgc.compressed_layers(reloaded)
    ids = torch.randint(0, 48, (1, 6))
    torch.testing.assert_close(reloaded(ids).logits, model(ids).logits)


def test_errors_leave_the_model_untouched():
    model = TinyBlockLM()
    with pytest.raises(ValueError, match=r"matched no module.*q_proj"):
        rgc.wrap(model, rank=4, targets=["attn"])
    with pytest.raises(TypeError, match="not an nn.Linear"):
        rgc.wrap(model, rank=4, targets=["norm"])
    with pytest.raises(ValueError, match="rank <= in_features"):
        rgc.wrap(model, rank=100)
    with pytest.raises(ValueError, match="rank must be"):
        rgc.wrap(model, rank=0)
    with pytest.raises(ValueError, match=r"rank must be an integer >= 1 \(not a bool\)"):
        rgc.wrap(model, rank=True)
    with pytest.raises(TypeError, match="targets must be"):
        rgc.wrap(model, rank=2, targets="q_proj")
    with pytest.raises(ValueError, match="refresh"):
        rgc.wrap(model, rank=2, refresh=0)
    half = TinyBlockLM().to(torch.float16)
    with pytest.raises(TypeError, match="dtype"):
        rgc.wrap(half, rank=2)
    assert not rgc.compressed_layers(model) and not rgc.compressed_layers(half)
    assert all(p.requires_grad for p in model.parameters())
    rgc.wrap(model, rank=2)
    with pytest.raises(ValueError, match="already wrapped"):
        rgc.wrap(model, rank=2)


def test_conv1d_target_error_explains():
    from transformers.pytorch_utils import Conv1D

    model = nn.Module()
    model.c_attn = Conv1D(12, 4)
    with pytest.raises(TypeError, match="Conv1D"):
        rgc.wrap(model, rank=2)


class CustomProjection(nn.Module):
    """A projection that is not an nn.Linear (a parameter of its own, its own forward)."""

    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * self.scale


def test_a_target_rgc_cannot_sketch_is_skipped_with_a_warning():
    model = TinyBlockLM()
    for block in model.blocks:
        block.q_proj = CustomProjection(24)
    with pytest.warns(UserWarning, match=r"skips targets it cannot sketch.*blocks\.\*\.q_proj "
                                         r"\(a CustomProjection, not an nn.Linear\)"):
        rgc.wrap(model, rank=2)
    names = {n.rsplit(".", 1)[-1] for n, _ in rgc.compressed_layers(model)}
    assert names == PROJ_NAMES - {"q_proj"}
    assert not model.blocks[0].q_proj.scale.requires_grad


def test_deepcopy_of_wrapped_model_trains_its_own_weights():
    import copy

    model = rgc.wrap(TinyBlockLM(), rank=4)
    clone = copy.deepcopy(model)
    opt = rgc.RGCOptimizer(clone.parameters(), lr=0.01)
    before = model.blocks[0].q_proj.weight.detach().clone()
    clone(torch.randint(0, 32, (2, 5))).sum().backward()
    opt.step()
    assert torch.equal(model.blocks[0].q_proj.weight, before)
    assert not torch.equal(clone.blocks[0].q_proj.weight, before)
