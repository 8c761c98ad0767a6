import copy
import math

import pytest
import torch

import rgc
from tests.models import TinyBlockLM


def loss_of(model, ids):
    return model(ids).square().mean()


@pytest.mark.slow  # a model's first AdamW and RGC steps
def test_first_update_matches_a_first_adamw_step():
    adamw_lr = 1e-4
    ids = torch.randint(0, 32, (4, 7))
    plain = TinyBlockLM()
    model = rgc.wrap(copy.deepcopy(plain), rank=4)
    names = [n + ".weight" for n, _ in rgc.compressed_layers(model)]

    # dense AdamW's first step on the same weights, computed with torch.optim.AdamW
    params = dict(plain.named_parameters())
    adam = torch.optim.AdamW([params[n] for n in names], lr=adamw_lr, weight_decay=0.0)
    before = {n: params[n].detach().double().clone() for n in names}
    loss_of(plain, ids).backward()
    adam.step()
    adam_moved = math.sqrt(sum((params[n].double() - before[n]).square().sum().item()
                               for n in names))

    tau = rgc.calibrate_lr(model, adamw_lr=adamw_lr)
    opt = rgc.RGCOptimizer(model.parameters(), lr=tau)
    loss_of(model, ids).backward()
    opt.step()
    rgc_params = dict(model.named_parameters())
    rgc_moved = math.sqrt(sum((rgc_params[n].double() - before[n]).square().sum().item()
                              for n in names))
    numel = sum(before[n].numel() for n in names)
    assert adam_moved == pytest.approx(adamw_lr * math.sqrt(numel), rel=1e-2)
    assert rgc_moved == pytest.approx(adam_moved, rel=1e-2)


def test_needs_a_wrapped_model_and_positive_lr():
    with pytest.raises(ValueError, match="wrapped model"):
        rgc.calibrate_lr(TinyBlockLM())
    with pytest.raises(ValueError, match="adamw_lr"):
        rgc.calibrate_lr(rgc.wrap(TinyBlockLM(), rank=2), adamw_lr=0.0)
