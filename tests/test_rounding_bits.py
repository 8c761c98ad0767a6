"""The hash and rounding of rgc.ops (reference, compiled and eager) against the hash written
with Python integers."""

import contextlib
import functools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rgc.bits import random_bits, seed_words
from rgc.ops import reference
from rgc.rounding import random_words, stochastic_round

M32 = 0xFFFFFFFF


def mix32_int(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def bits_int(n: int, seed: int) -> int:
    s_lo, s_hi = seed_words(seed)
    return mix32_int(mix32_int((n & M32) ^ s_lo) ^ (((n >> 32) + s_hi) & M32))


def round_int(x: float, n: int, seed: int) -> int:
    """BF16 bit pattern (uint16) of one FP32 value, rounded with the bits of index n."""
    pattern = torch.tensor([x], dtype=torch.float32).view(torch.int32).item() & M32
    return (((pattern + (bits_int(n, seed) & 0xFFFF)) & M32) >> 16) & 0xFFFF


CPU_PATHS = pytest.mark.parametrize("cpu_path", ["compiled", "eager"])


@contextlib.contextmanager
def on(cpu_path):
    """Run the body with the CPU's compiled hash loop, or with the same function in eager torch
    ops (what runs on other devices, and where torch.compile cannot)."""
    with pytest.MonkeyPatch.context() as mp:
        if cpu_path == "eager":
            mp.setattr(reference, "_int32_loop", lambda fn, device: fn)
        yield


@CPU_PATHS
@given(seed=st.integers(0, 2**64 - 1),
       offset=st.one_of(st.integers(0, 2**20), st.integers(2**32 - 300, 2**32 + 300),
                        st.integers(0, 2**62)),
       n=st.integers(1, 600))
def test_stochastic_round_matches_python_integer_hash(cpu_path, seed, offset, n):
    with on(cpu_path):
        g = torch.Generator().manual_seed(n)
        x = torch.randn(n, generator=g) * 10.0 ** torch.randint(-38, 38, (n,), generator=g)
        want = [round_int(v, offset + i, seed) for i, v in enumerate(x.tolist())]
        out = stochastic_round(x, seed=seed, offset=offset)
        assert [b & 0xFFFF for b in out.view(torch.int16).tolist()] == want
        # The int64 helper stays the documented bit source.
        ref = random_bits(n, seed=seed, offset=offset).tolist()
        assert ref == [bits_int(offset + i, seed) for i in range(n)]


@CPU_PATHS
@pytest.mark.parametrize("nan_bits", [0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF,
                                      0xFF800001])
def test_nan_stays_nan_between_finite_values(cpu_path, nan_bits):
    # Every path stores a NaN as the quiet NaN of its sign: the upper half with bit 6 set.
    with on(cpu_path):
        x = torch.randn(1000) * 10.0 ** torch.randint(-38, 38, (1000,))
        x[517] = torch.tensor([nan_bits], dtype=torch.int64).to(torch.int32).view(torch.float32)
        offset = 2**32 - 300
        got = stochastic_round(x, seed=4, offset=offset).view(torch.int16).tolist()
        assert got[517] & 0xFFFF == (nan_bits >> 16) | 0x40
        for i, v in enumerate(x.tolist()):
            if i != 517:
                assert got[i] & 0xFFFF == round_int(v, offset + i, 4)


@CPU_PATHS
def test_long_input_crossing_blocks_and_the_2_32_boundary(cpu_path):
    # Longer than several CPU blocks, with offset + i crossing 2**32 inside a later block;
    # reference: the int64 random_bits and the rounding written out in int64.
    with on(cpu_path):
        n = 3 * 2**15 + 123
        offset = 2**32 - 2 * 2**15 - 7
        x = torch.randn(n) * 100
        bits = random_bits(n, seed=99, offset=offset)
        pattern = x.view(torch.int32).to(torch.int64) & M32
        want = (((pattern + (bits & 0xFFFF)) & M32) >> 16).to(torch.int32)
        got = stochastic_round(x, seed=99, offset=offset).view(torch.int16).to(torch.int32) & 0xFFFF
        assert torch.equal(got, want)


@CPU_PATHS
@given(seed=st.integers(0, 2**63 - 1), offset=st.integers(2**32 - 200, 2**32 + 50),
       n=st.integers(1, 400))
def test_hash_words_on_every_path(cpu_path, seed, offset, n):
    with on(cpu_path):
        want = random_bits(n, seed=seed, offset=offset, label="some-stream")
        words = random_words(n, seed=seed, offset=offset, label="some-stream")
        assert words.dtype == torch.int32
        assert torch.equal(words.to(torch.int64) & M32, want)


def test_with_dynamo_disabled_the_first_rounding_is_rounded_once(monkeypatch):
    """Under ``TORCHDYNAMO_DISABLE=1`` torch.compile's wrapper runs the in-place loop eagerly
    and then raises; the first write of a process must still round its input only once."""
    x = torch.randn(700) * 3.0
    want = [round_int(v, 11 + i, 5) for i, v in enumerate(x.tolist())]
    # wrappers whose first call has not happened yet (the process's own keep theirs)
    monkeypatch.setattr(reference, "_compiled", functools.cache(reference._compiled.__wrapped__))
    with torch._dynamo.config.patch(disable=True):
        out = stochastic_round(x, seed=5, offset=11)
    assert [b & 0xFFFF for b in out.view(torch.int16).tolist()] == want


@CPU_PATHS
@given(seed=st.integers(0, 2**64 - 1),
       offset=st.one_of(st.integers(0, 2**20), st.integers(2**32 - 400, 2**32 + 100)),
       d=st.integers(1, 9), k=st.integers(1, 40), decay=st.sampled_from([None, 0.25]),
       chunk_rows=st.integers(1, 4))
def test_update_writes_the_rounding_of_its_fp32_value(cpu_path, seed, offset, d, k, decay,
                                                     chunk_rows):
    """lowrank_update_'s one pass stores, at element (i, j), the Python-integer rounding (index
    offset + i k + j) of float32(W) (1 - decay) - rebuilt row, the rebuilt rows formed here with
    the same FP32 products."""
    g = torch.Generator().manual_seed(d * 100 + k)
    w = (torch.randn(1, d, k, generator=g) * 4).bfloat16()
    u, p = torch.randn(1, d, 3, generator=g), torch.randn(k, 3, generator=g).bfloat16()
    coef = torch.full((1, 1), 0.5)
    decays = None if decay is None else torch.full((1, 1), decay)
    factor = torch.tensor(1.0 if decay is None else 1.0 - decay, dtype=torch.float32)
    h = torch.cat([(u[0, s:s + chunk_rows] * coef[0, 0]) @ p.float().t()
                   for s in range(0, d, chunk_rows)])
    new = (w[0].float() * factor - h).flatten().tolist()
    want = [round_int(v, offset + i, seed) for i, v in enumerate(new)]
    with on(cpu_path):
        reference.lowrank_update_([w], [u], [p], coef, decays, [seed], [offset], [k], True,
                                  chunk_rows, None)
    assert [b & 0xFFFF for b in w.view(torch.int16).flatten().tolist()] == want
