"""The vLLM receiver's sharded apply and fingerprint shares, on shards cut from a plain model.

No engine is needed: a tensor-parallel rank's shard of a weight is a block of rows (column-
parallel layers) or of columns (row-parallel layers) of the trainer's matrix; each block is
updated on its own here and the blocks, put together, must equal the trainer's updated
weight bit for bit.
"""

import pytest
import torch
import torch.nn as nn
from hypothesis import given
from hypothesis import strategies as st

import rgc
from rgc.integrations.vllm.layout import Piece, combine, piece_fingerprint
from rgc.integrations.vllm.receiver import Receiver
from rgc.payload import PayloadError, decode, fingerprint

D, K, VOCAB = 21, 18, 13


class Net(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, K, dtype=dtype)
        self.up = nn.Linear(K, D, bias=False, dtype=dtype)
        self.down = nn.Linear(D, K, bias=False, dtype=dtype)
        self.norm = nn.LayerNorm(K, dtype=dtype)

    def forward(self, ids):
        return self.norm(self.down(torch.tanh(self.up(self.embed(ids)))))


def _trained(dtype, opt_name, chunk_rows, seed):
    torch.manual_seed(seed)
    model = Net(dtype)
    rgc.wrap(model, rank=4, targets=["up", "down"], seed=seed)
    model.embed.weight.requires_grad_(True)
    model.norm.weight.requires_grad_(True)
    if opt_name == "rgc":
        opt = rgc.RGCOptimizer(model.parameters(), lr=5e-2, chunk_rows=chunk_rows,
                               keep_updates=True, seed=seed)
    else:
        opt = rgc.RowAdam(model.parameters(), lr=2e-2, weight_decay=0.2, chunk_rows=chunk_rows,
                          keep_updates=True, seed=seed)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ids = torch.randint(0, VOCAB, (3, 7), generator=torch.Generator().manual_seed(seed))
    model(ids).float().square().mean().backward()
    opt.step()
    return before, model, opt.export_update(model)


def _cuts(n, draw_points):
    points = sorted(set(draw_points) | {0, n})
    return list(zip(points[:-1], points[1:]))


@pytest.mark.slow  # 25 trainer steps and receivers
@given(dtype=st.sampled_from([torch.bfloat16, torch.float32]),
       opt_name=st.sampled_from(["rgc", "rowadam"]), chunk_rows=st.integers(1, 9),
       seed=st.integers(0, 2**20), data=st.data())
def test_blocks_updated_apart_equal_the_trainers_weight(dtype, opt_name, chunk_rows, seed, data):
    before, model, payload = _trained(dtype, opt_name, chunk_rows, seed)
    entries = decode(payload).entries
    assert {e.name for e in entries} == {"embed.weight", "up.weight", "down.weight",
                                         "norm.weight"}
    receiver = Receiver(model=None)
    trained = dict(model.named_parameters())
    for entry in entries:
        full = before[entry.name].reshape(entry.d, entry.k)
        by_rows = data.draw(st.booleans(), label=f"{entry.name} cut by rows")
        n = entry.d if by_rows else entry.k
        cuts = _cuts(n, data.draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=3)))
        # kept: the commit copies the checked values in; not kept: it rebuilds them
        budget = data.draw(st.sampled_from([None, 0, 64]), label="bytes kept")
        out = torch.empty_like(full)
        new_shares, written_shares = [], []
        for a, b in cuts:
            rows, cols = ((a, b), (0, entry.k)) if by_rows else ((0, entry.d), (a, b))
            # the engine's parameter: this block, with two unrelated rows before it
            shard = full[rows[0]:rows[1], cols[0]:cols[1]]
            param = torch.cat([torch.ones(2, shard.shape[1], dtype=dtype), shard]).clone()
            piece = Piece("w", 2, rows[0], rows[1] - rows[0], cols[0], cols[1] - cols[0],
                          entry.d, entry.k)
            params = {"w": param}
            items, kept = receiver.prepare_piece(entry, piece, params, budget=budget)
            new_shares += [(key, share) for key, _, share in items]
            assert torch.equal(param[2:], shard), "the check pass wrote into the weight"
            written = receiver.commit_piece(entry, piece, params, kept)
            written_shares += [(key, new if share is None else share)
                               for (key, share), (_, _, new) in zip(written, items, strict=True)]
            assert torch.equal(param[:2], torch.ones_like(param[:2]))
            out[rows[0]:rows[1], cols[0]:cols[1]] = param[2:]
        expected = trained[entry.name].detach().reshape(entry.d, entry.k)
        assert torch.equal(out, expected), f"{entry.name} cut into {cuts} (rows: {by_rows})"
        assert combine(new_shares, entry.d, entry.k, entry.name) == entry.result
        assert combine(written_shares, entry.d, entry.k, entry.name) == entry.result


@given(d=st.integers(1, 40), k=st.integers(1, 40),
       dtype=st.sampled_from([torch.bfloat16, torch.float32]), seed=st.integers(0, 2**20),
       data=st.data())
def test_fingerprint_shares_of_a_grid_add_up_to_the_fingerprint(d, k, dtype, seed, data):
    t = torch.randn(d, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    row_cuts = _cuts(d, data.draw(st.lists(st.integers(1, max(d - 1, 1)), max_size=3)))
    col_cuts = _cuts(k, data.draw(st.lists(st.integers(1, max(k - 1, 1)), max_size=3)))
    shares = [((r0, r1 - r0, c0, c1 - c0), piece_fingerprint(t[r0:r1, c0:c1], r0, c0, k))
              for r0, r1 in row_cuts for c0, c1 in col_cuts]
    replicated = shares + shares[:1]  # a second rank's copy of one block
    assert combine(replicated, d, k, "t") == fingerprint(t)


def test_combine_refuses_disagreeing_copies_and_gaps():
    t = torch.randn(4, 6)
    top, bottom = piece_fingerprint(t[:2], 0, 0, 6), piece_fingerprint(t[2:], 2, 0, 6)
    with pytest.raises(RuntimeError, match="replicated"):
        combine([((0, 2, 0, 6), top), ((0, 2, 0, 6), top + 1), ((2, 2, 0, 6), bottom)],
                4, 6, "t")
    with pytest.raises(RuntimeError, match="hold 12 of the 24"):
        combine([((0, 2, 0, 6), top)], 4, 6, "t")


def test_decode_refuses_a_changed_payload_before_reading_it():
    _, _, payload = _trained(torch.bfloat16, "rowadam", 4, 0)
    payload["up.weight/factor"] = payload["up.weight/factor"] * 2
    with pytest.raises(PayloadError, match="checksum"):
        decode(payload)
    with pytest.raises(PayloadError, match="not an rgc sync payload"):
        decode({"up.weight/factor": torch.zeros(1)})
