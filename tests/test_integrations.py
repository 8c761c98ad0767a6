"""rgc.integrations: gradient norm and clipping from the sketches, accelerate, Trainer, TRL."""

import importlib.util
import sys
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import rgc
from rgc.integrations import clip_grad_norm_, grad_norm, with_rgc

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load_example(name):
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def mlp(seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 16), nn.Tanh(), nn.Linear(16, 6))
    rgc.wrap(model, rank=4, targets=["0", "2"], freeze_others=False)
    return model


def batch(seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(5, 12, generator=gen), torch.randn(5, 6, generator=gen)


def loss_of(model, seed):
    x, y = batch(seed)
    return (model(x) - y).square().mean()


def reference_norm(model) -> float:
    """sqrt(sum ||C P^T||^2 + sum ||bias grad||^2), dense in float64."""
    total = 0.0
    for layer in (model[0], model[2]):
        h = layer.sketch.double() @ layer.projection.double().t()
        total += float(h.square().sum()) + float(layer.bias.grad.double().square().sum())
    return total ** 0.5


def test_grad_norm_is_that_of_the_sketched_estimate():
    model = mlp()
    opt = rgc.RowAdam(model.parameters(), lr=1e-3)
    assert float(grad_norm(opt)) == 0.0
    loss_of(model, 1).backward()
    assert torch.nn.utils.get_total_norm([p.grad for p in model.parameters()
                                          if p.grad is not None]) > 0  # biases only
    assert float(grad_norm(opt)) == pytest.approx(reference_norm(model), rel=1e-5)


def test_clipping_is_honoured_for_rowadam():
    model = mlp()
    opt = rgc.RowAdam(model.parameters(), lr=1e-3)
    loss_of(model, 1).backward()
    before = reference_norm(model)
    sketch = model[0].sketch.clone()
    max_norm = before / 4
    assert float(clip_grad_norm_(opt, max_norm)) == pytest.approx(before, rel=1e-5)
    assert reference_norm(model) == pytest.approx(max_norm, rel=1e-4)
    torch.testing.assert_close(model[0].sketch, sketch * (max_norm / before), rtol=1e-5, atol=0)
    assert float(clip_grad_norm_(opt, 10 * before)) == pytest.approx(max_norm, rel=1e-4)


def test_clipping_is_declined_for_rgc_with_one_warning():
    model = mlp()
    opt = rgc.RGCOptimizer(model.parameters(), lr=1e-3)
    loss_of(model, 1).backward()
    sketch = model[0].sketch.clone()
    with pytest.warns(UserWarning, match="no effect with RGCOptimizer"):
        clip_grad_norm_(opt, 1e-6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        clip_grad_norm_(opt, 1e-6)
    assert torch.equal(model[0].sketch, sketch)


def test_accelerate_accumulate_save_and_load_state(tmp_path):
    accelerate = pytest.importorskip("accelerate")

    def manual(steps):
        model = mlp()
        opt = rgc.RowAdam(model.parameters(), lr=1e-2)
        for step in range(steps):
            for micro in range(2):
                (loss_of(model, 10 * step + micro) / 2).backward()
            clip_grad_norm_(opt, 0.5)
            opt.step()
            opt.zero_grad()
        return model

    def accelerated(acc, model, opt, steps, start=0):
        for step in range(start, start + steps):
            for micro in range(2):
                with acc.accumulate(model):
                    acc.backward(loss_of(model, 10 * step + micro))
                    if acc.sync_gradients:
                        clip_grad_norm_(opt, 0.5)
                    opt.step()
                    opt.zero_grad()

    acc = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    start = mlp()
    model, opt = acc.prepare(start, rgc.RowAdam(start.parameters(), lr=1e-2))
    accelerated(acc, model, opt, steps=2)
    acc.save_state(str(tmp_path / "state"))
    accelerated(acc, model, opt, steps=1, start=2)
    want = manual(3)
    for p, q in zip(model.parameters(), want.parameters()):
        assert torch.equal(p, q)

    acc2 = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2)
    fresh = mlp(seed=5)
    model2, opt2 = acc2.prepare(fresh, rgc.RowAdam(fresh.parameters(), lr=1e-2))
    acc2.load_state(str(tmp_path / "state"))
    accelerated(acc2, model2, opt2, steps=1, start=2)
    for p, q in zip(model2.parameters(), want.parameters()):
        assert torch.equal(p, q)


def test_plain_trainer_default_optimizer_refused_and_optimizers_argument(tmp_path):
    transformers = pytest.importorskip("transformers")
    example = load_example("hf_trainer")
    model = rgc.wrap(transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16)), rank=4)
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=1,
                                          per_device_train_batch_size=4, report_to="none",
                                          use_cpu=True, save_strategy="no")
    trainer = transformers.Trainer(model=model, args=args,
                                   train_dataset=example.counting_data(8, 0))
    with pytest.raises(RuntimeError, match="AdamW is stepping the weight of a CompressedLinear"):
        trainer.train()
    for n, p in model.named_parameters():
        assert torch.equal(p, weights[n]), n

    # a plain Trainer given an rgc optimizer: it would log grad_norm 0.0; one warning says so
    for _, layer in rgc.compressed_layers(model):
        layer.zero_sketch()
    plain_args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2,
                                                per_device_train_batch_size=4, report_to="none",
                                                use_cpu=True, save_strategy="no")
    plain = transformers.Trainer(model=model, args=plain_args,
                                 optimizers=(rgc.RowAdam(model.parameters(), lr=1e-3), None),
                                 train_dataset=example.counting_data(8, 0))
    with pytest.warns(UserWarning, match="logs grad_norm = 0.0 and clips nothing") as caught:
        plain.train()
    assert sum("grad_norm = 0.0" in str(w.message) for w in caught) == 1

    # the optimizers= path of the rgc subclass: grad_norm is logged from the sketches
    for _, layer in rgc.compressed_layers(model):
        layer.zero_sketch()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=2,
                                          per_device_train_batch_size=4, report_to="none",
                                          use_cpu=True, save_strategy="no", logging_steps=1,
                                          max_grad_norm=1e-3)
    opt = rgc.RowAdam(model.parameters(), lr=1e-3)
    trainer = with_rgc(transformers.Trainer)(model=model, args=args, optimizers=(opt, None),
                                             train_dataset=example.counting_data(8, 0))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*grad_norm = 0.0.*")
        trainer.train()
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(norms) == 2 and all(n > 1e-3 for n in norms)
    assert trainer.optimizer.optimizer is opt and opt.steps_taken == 2


def assert_checkpoint_is_plain(path, trained):
    from transformers import Qwen3ForCausalLM

    plain = Qwen3ForCausalLM.from_pretrained(path)
    assert not rgc.compressed_layers(plain)
    want = trained.state_dict()
    got = plain.state_dict()
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_hf_trainer_example(tmp_path):
    pytest.importorskip("transformers")
    result = load_example("hf_trainer").main(["--steps", "6", "--out", str(tmp_path)])
    assert result["loss_after"] < result["loss_before"] - 0.3
    assert all(g > 0 for g in result["grad_norms"])
    assert_checkpoint_is_plain(result["checkpoint"], result["model"])


def test_trl_grpo_example(tmp_path):
    pytest.importorskip("trl")
    example = load_example("trl_grpo")
    result = example.main(["--steps", "3", "--kl-budget", "0.1", "--out", str(tmp_path)])
    assert result["p_digit_after"] > result["p_digit_before"] + 0.03
    assert result["grad_norm_last"] > 0 and 0 < result["alpha_last"] <= 1
    from transformers import Qwen3ForCausalLM

    trained = Qwen3ForCausalLM.from_pretrained(result["out"])
    base = Qwen3ForCausalLM.from_pretrained(tmp_path / "base")
    changed = [n for n, p in trained.named_parameters()
               if not torch.equal(p, base.get_parameter(n))]
    assert changed and all(n.endswith("proj.weight") for n in changed)
