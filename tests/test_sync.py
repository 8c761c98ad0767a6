import copy

import pytest
import torch

import rgc
from rgc.payload import FINGERPRINT_A, FINGERPRINT_B, fingerprint, payload_checksum
from tests.models import TwoLayerNet

safetensors_torch = pytest.importorskip("safetensors.torch")

D_IN, HIDDEN, D_OUT = 24, 20, 12


def _base():
    torch.manual_seed(0)
    return TwoLayerNet(D_IN, HIDDEN, D_OUT).to(torch.bfloat16)


def _trainer(base, opt_name, *, step_control=None):
    model = copy.deepcopy(base)
    if opt_name == "rgc_momentum":  # momentum carried across a refresh every 3 updates
        rgc.wrap(model, 4, refresh=3)
    else:
        rgc.wrap(model, 4, preset="rgc" if opt_name == "rgc" else "logra")
    model.norm.weight.requires_grad_(True)  # a dense trainable parameter travels too
    if opt_name.startswith("rgc"):
        opt = rgc.RGCOptimizer(model.parameters(), lr=2e-2, keep_updates=True,
                               step_control=step_control,
                               momentum=0.9 if opt_name == "rgc_momentum" else 0.0,
                               row_norm=opt_name == "rgc_momentum")
    else:
        opt = rgc.RowAdam(model.parameters(), lr=1e-2, weight_decay=0.1, keep_updates=True,
                          step_control=step_control)
    return model, opt


def _step(model, opt, step):
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(step)).to(torch.bfloat16)
    opt.zero_grad()
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    return x


@pytest.mark.parametrize("opt_name, controlled, as_state_dict", [
    ("rgc", False, False), ("rgc_momentum", True, False), ("rowadam", True, True),
    ("rowadam", False, False)])
def test_receiver_stays_bit_identical_for_20_steps(opt_name, controlled, as_state_dict):
    base = _base()
    ctl = rgc.PredictedKL(1e-3, 1e-4, anneal_steps=10, max_scale=4.0) if controlled else None
    model, opt = _trainer(base, opt_name, step_control=ctl)
    receiver = copy.deepcopy(base)  # a plain, unwrapped copy
    target = receiver.state_dict() if as_state_dict else receiver
    if ctl is not None:
        ctl.set_probe(model, torch.randn(5, D_IN).to(torch.bfloat16))
    for step in range(1, 21):
        _step(model, opt, step)
        payload = opt.export_update(model)
        assert int(payload["rgc/step"]) == step
        wire = safetensors_torch.save(payload)
        rgc.apply_update(target, safetensors_torch.load(wire))
        for (name, p), q in zip(model.named_parameters(), receiver.parameters(), strict=True):
            assert torch.equal(p, q), f"{name} differs after step {step}"
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, dict(
        base.named_parameters())[n])]
    assert set(moved) == {"up_proj.weight", "up_proj.bias", "down_proj.weight", "norm.weight"}
    if ctl is not None:
        assert len({r["alpha"] for r in ctl.history}) > 1


def _snapshot(module):
    return {n: p.clone() for n, p in module.named_parameters()}


def _one_step_payload():
    base = _base()
    model, opt = _trainer(base, "rowadam")
    _step(model, opt, 1)
    return base, model, opt


def _tamper_cases(payload):
    def drop_row(p):
        p["down_proj.weight/factor"] = p["down_proj.weight/factor"][:-1].clone()

    def rename(p):
        for key in [k for k in p if k.startswith("down_proj.weight/")]:
            p[key.replace("down_proj", "out_proj")] = p.pop(key)

    def rank(p):
        spec = p["up_proj.weight/projection"].clone()
        spec[2] += 1
        p["up_proj.weight/projection"] = spec

    def dense_shape(p):
        p["norm.weight/direction"] = torch.zeros(HIDDEN + 1)

    def missing_field(p):
        del p["up_proj.weight/seed"]

    def nonfinite(p):
        p["norm.weight/direction"] = torch.full((HIDDEN,), float("nan"))

    def fmt(p):
        p["rgc/format"] = torch.tensor([7])

    return {"wrong factor shape": (drop_row, "does not fit"),
            "unknown layer": (rename, "does not have"),
            "wrong rank": (rank, "does not fit"),
            "wrong dense shape": (dense_shape, "does not fit"),
            "missing field": (missing_field, "expected"),
            "non-finite": (nonfinite, "non-finite"),
            "format": (fmt, "format")}


@pytest.mark.parametrize("case", list(_tamper_cases({})))
def test_tampered_payload_is_rejected_and_receiver_untouched(case):
    """Each structural check, on payloads re-sealed with a valid checksum after the change."""
    base, model, opt = _one_step_payload()
    payload = dict(opt.export_update(model))
    tamper, match = _tamper_cases(payload)[case]
    tamper(payload)
    payload["rgc/checksum"] = payload_checksum(payload)
    receiver = copy.deepcopy(base)
    before = _snapshot(receiver)
    with pytest.raises(ValueError, match=match):
        rgc.apply_update(receiver, payload)
    for n, p in receiver.named_parameters():
        assert torch.equal(p, before[n]), n
    assert not hasattr(receiver, "rgc_sync_step")


def _flip_one_bit(t: torch.Tensor, index: int) -> torch.Tensor:
    out = t.clone()
    out.view(-1).view(torch.int32)[index] ^= 1
    return out


@pytest.mark.parametrize("key, index", [("up_proj.weight/factor", 0),
                                        ("down_proj.weight/factor", 37),
                                        ("norm.weight/direction", 5)])
def test_payload_changed_in_transit_is_refused_before_anything_is_applied(key, index):
    """One bit of one value changed after export (checksum not updated): nothing is applied."""
    import hashlib

    base, model, opt = _one_step_payload()
    payload = dict(opt.export_update(model))
    # the checksum is SHA-256 over key, dtype, shape and bytes of every entry, in key order
    digest = hashlib.sha256()
    for k in sorted(payload):
        if k != "rgc/checksum":
            t = payload[k].contiguous().reshape(-1)
            digest.update(f"{k}\0{t.dtype}\0{tuple(payload[k].shape)}\0".encode())
            digest.update(t.view(torch.uint8).numpy().tobytes())
    assert payload["rgc/checksum"].tolist() == list(digest.digest())
    payload[key] = _flip_one_bit(payload[key], index)
    receiver = copy.deepcopy(base)
    before = _snapshot(receiver)
    with pytest.raises(ValueError, match="checksum"):
        rgc.apply_update(receiver, payload)
    assert all(torch.equal(p, before[n]) for n, p in receiver.named_parameters())
    assert not hasattr(receiver, "rgc_sync_step")
    missing = dict(opt.export_update(model))
    del missing["rgc/checksum"]
    with pytest.raises(ValueError, match="checksum"):
        rgc.apply_update(copy.deepcopy(base), missing)


def test_diverging_receiver_raises_at_the_step_it_diverges(monkeypatch):
    """A receiver whose arithmetic gives other bits (here: round-to-nearest instead of the
    trainer's stochastic rounding) is told at that step, not one step later."""
    base, model, opt = _one_step_payload()
    payload = opt.export_update(model)
    receiver = copy.deepcopy(base)
    real = rgc.sync.apply_lowrank_update_

    def other_bits(*args, **kwargs):
        real(*args, **{**kwargs, "stochastic_rounding": False})

    monkeypatch.setattr(rgc.sync, "apply_lowrank_update_", other_bits)
    with pytest.raises(RuntimeError, match="differ from the trainer"):
        rgc.apply_update(receiver, payload)
    assert not hasattr(receiver, "rgc_sync_step")
    monkeypatch.undo()
    fine = copy.deepcopy(base)
    rgc.apply_update(fine, payload)
    assert fine.rgc_sync_step == 1


def test_wrong_step_order_and_wrong_base_are_rejected():
    base = _base()
    model, opt = _trainer(base, "rgc")
    payloads = []
    for step in (1, 2):
        _step(model, opt, step)
        payloads.append(opt.export_update(model))
    # a fresh receiver that missed step 1: its weights are not step 2's base
    skipped = copy.deepcopy(base)
    with pytest.raises(ValueError, match="fingerprint"):
        rgc.apply_update(skipped, payloads[1])
    assert all(torch.equal(p, q) for p, q in zip(skipped.parameters(), base.parameters(),
                                                 strict=True))
    receiver = copy.deepcopy(base)
    rgc.apply_update(receiver, payloads[0])
    before = _snapshot(receiver)
    with pytest.raises(ValueError, match="wrong step order"):
        rgc.apply_update(receiver, payloads[0])  # replayed
    state = receiver.state_dict()
    with pytest.raises(ValueError, match="fingerprint"):
        rgc.apply_update(state, payloads[0])  # a state dict has no step record: the base check
    assert all(torch.equal(p, before[n]) for n, p in receiver.named_parameters())
    rgc.apply_update(receiver, payloads[1])
    assert all(torch.equal(p, q) for p, q in zip(receiver.parameters(), model.parameters(),
                                                 strict=True))


def test_receiver_dtype_mismatch_and_export_misuse():
    base, model, opt = _one_step_payload()
    payload = opt.export_update(model)
    receiver = copy.deepcopy(base).float()
    with pytest.raises(ValueError, match="dtype|bfloat16"):
        rgc.apply_update(receiver, payload)
    plain = rgc.RGCOptimizer(rgc.wrap(copy.deepcopy(base), 4).parameters(), lr=1e-2)
    with pytest.raises(RuntimeError, match="keep_updates"):
        plain.export_update(model)
    fresh = rgc.RowAdam(rgc.wrap(copy.deepcopy(base), 4).parameters(), lr=1e-2,
                        keep_updates=True)
    with pytest.raises(RuntimeError, match="before the first step"):
        fresh.export_update(model)


def test_payload_is_sketch_sized():
    """Per compressed layer the payload is the d x r FP32 factor plus 25 words of metadata."""
    _, model, opt = _one_step_payload()
    payload = opt.export_update(model)
    for name, layer in rgc.compressed_layers(model):
        fields = {k: v for k, v in payload.items() if k.startswith(f"{name}.weight/")}
        nbytes = sum(v.numel() * v.element_size() for v in fields.values())
        d, r = layer.out_features, layer.rank
        assert nbytes == 4 * d * r + 8 * (1 + 1 + 1 + 4 + 3 + 1 + 1)
    assert payload["rgc/checksum"].dtype == torch.uint8 and payload["rgc/checksum"].numel() == 32


@pytest.mark.parametrize("dtype, width", [(torch.bfloat16, 16), (torch.float32, 32)])
def test_fingerprint_follows_its_formula_and_sees_one_ulp(dtype, width):
    t = torch.randn(7, 5).to(dtype)
    ints = t.view(torch.int16 if width == 16 else torch.int32).flatten().tolist()
    m = 2 ** 31 - 1
    expected = sum((b % 2 ** width) * ((i * FINGERPRINT_A + FINGERPRINT_B) % m)
                   for i, b in enumerate(ints)) % m
    assert fingerprint(t) == expected
    bumped = t.clone()
    bumped.view(torch.int16 if width == 16 else torch.int32)[3, 2] += 1
    assert fingerprint(bumped) != fingerprint(t)
