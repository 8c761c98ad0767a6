"""The payload format: what export writes decodes to the step's updates, encode and decode are
inverse, and only format 3 is read."""

import copy
import types

import pytest
import torch

import rgc
from rgc.payload import (
    FORMAT_VERSION,
    KeptUpdate,
    PayloadError,
    build_payload,
    decode,
    encode,
    payload_checksum,
)
from tests.models import TwoLayerNet

D_IN, HIDDEN, D_OUT, RANK = 24, 20, 12, 4


def _plain_fingerprint(t: torch.Tensor) -> int:
    """The fingerprint's formula over the tensor's unsigned bit patterns, in Python ints."""
    width = 16 if t.dtype == torch.bfloat16 else 32
    bits = t.detach().reshape(-1).view(torch.int16 if width == 16 else torch.int32).tolist()
    m = 2 ** 31 - 1
    return sum((b % 2 ** width) * ((i * 1_103_515_245 + 12_345) % m)
               for i, b in enumerate(bits)) % m


def _one_step():
    torch.manual_seed(0)
    model = rgc.wrap(TwoLayerNet(D_IN, HIDDEN, D_OUT).to(torch.bfloat16), RANK, preset="logra")
    model.norm.weight.requires_grad_(True)
    opt = rgc.RowAdam(model.parameters(), lr=1e-2, weight_decay=0.1, keep_updates=True)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.randn(6, D_IN, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    model(x).float().logsumexp(-1).mean().backward()
    opt.step()
    return model, opt, before


def test_export_decodes_to_the_steps_updates():
    model, opt, before = _one_step()
    payload = decode(opt.export_update(model))
    assert payload.step == 1
    entries = {e.name: e for e in payload.entries}
    params = dict(model.named_parameters())
    assert set(entries) == {n for n, p in params.items() if not torch.equal(p, before[n])}
    for name, layer in rgc.compressed_layers(model):
        e = entries[f"{name}.weight"]
        assert e.lowrank and e.stack is None and e.dtype == torch.bfloat16
        assert (e.d, e.k, e.projection.r) == (layer.out_features, layer.in_features, RANK)
        assert e.values.shape == (layer.out_features, RANK)
        assert e.values.dtype == torch.float32
        assert e.decay == pytest.approx(1e-2 * 0.1, rel=1e-6)
    norm = entries["norm.weight"]
    assert not norm.lowrank and norm.chunk_rows == 0 and norm.values.shape == (HIDDEN,)
    assert (norm.d, norm.k) == (HIDDEN, 1)
    for name, e in entries.items():
        assert e.base == _plain_fingerprint(before[name]), name
        assert e.result == _plain_fingerprint(params[name]), name


def test_encode_and_decode_are_inverse():
    model, opt, _ = _one_step()
    payload = opt.export_update(model)
    again = encode(decode(payload))
    assert list(again) == list(payload)
    for key, value in payload.items():
        assert again[key].dtype == value.dtype and torch.equal(again[key], value), key


@pytest.mark.parametrize("version", [2, 4])
def test_other_format_versions_are_refused(version):
    model, opt, _ = _one_step()
    payload = dict(opt.export_update(model))
    payload["rgc/format"] = torch.tensor([version])
    payload["rgc/checksum"] = payload_checksum(payload)
    with pytest.raises(PayloadError, match=rf"format \[{version}\].*format \[{FORMAT_VERSION}\]"):
        decode(payload)
    receiver = copy.deepcopy(model)
    with pytest.raises(ValueError, match="unsupported payload format"):
        rgc.apply_update(receiver, payload)


def test_decode_refuses_a_missing_step_and_build_refuses_other_updates():
    model, opt, _ = _one_step()
    payload = dict(opt.export_update(model))
    del payload["rgc/step"]
    payload["rgc/checksum"] = payload_checksum(payload)
    with pytest.raises(PayloadError, match="rgc/step"):
        decode(payload)
    p = model.norm.weight
    other = types.SimpleNamespace(param=p, active=True)
    with pytest.raises(TypeError, match="LowRankUpdate or DenseUpdate"):
        build_payload(model, [KeptUpdate(other, 0, None, 0)], 1)
