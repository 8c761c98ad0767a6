"""The engine side: read a payload, check it, replay it on the engine's own weight pieces.

One payload is applied in two passes over the same arithmetic, so that a payload the engine
cannot reproduce leaves its weights as they were:

1. :meth:`Receiver.prepare`: validate every entry (format, checksum, names, shapes, dtypes,
   finite values), fingerprint each piece as it is (``base``) and as the update would leave
   it (``new``), computed ``chunk_rows`` rows at a time in a scratch buffer; nothing is
   written. The trainer adds the shares of all ranks and compares them with the payload's
   ``N/base`` and ``N/result``.
2. :meth:`Receiver.commit`: write the update in place and fingerprint the result again.

A stack of experts is replayed expert by expert on the blocks of vLLM's fused-MoE weights that
hold it (:class:`~rgc.integrations.vllm.layout.ExpertPieces`): each block on the trainer's
grid of ``chunk_rows`` rows of its expert's matrix, in a scratch chunk of the trainer's width
(read from and written back to the engine's storage order), with the rounding bits of flat
index ``(e d + i) k + j``. Experts the trainer left unchanged (coefficient and decay 0) are
not rebuilt. No ``[E, d, k]`` FP32 temporary is made.

:func:`write_chunk` is the one place that calls the rgc core to write an update.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from rgc.integrations.vllm.layout import (
    ExpertPieces,
    Piece,
    expert_packing,
    locate,
    piece_fingerprint,
)
from rgc.payload import PayloadEntry, PayloadError, decode
from rgc.projection import make_projection
from rgc.updates import apply_dense_update_, apply_lowrank_update_

_DENSE_CHUNK = 1 << 22


def _check_supported(entry: PayloadEntry) -> None:
    """Refuse what this receiver does not write: stacks of experts stored transposed (gpt-oss'
    ``[E, k, d]``), 0-dim parameters."""
    if entry.stack is not None and entry.stack.transposed:
        raise PayloadError(
            f"payload entry {entry.name!r} updates a stack of experts stored transposed "
            "([E, k, d], as gpt-oss stores them), which this receiver does not write: resync "
            "those weights with push_weights(), or train the experts frozen")
    if entry.values.dim() < 1:
        raise PayloadError(f"payload {entry.name!r}: the update must have at least one "
                           f"dimension, got shape {tuple(entry.values.shape)}")


def _coefficients(entry: PayloadEntry, expert: int | None) -> tuple[float, float]:
    """``(coef, decay)`` of ``entry``, of matrix ``expert`` for a stack."""
    if expert is None:
        return entry.coef, entry.decay
    return float(entry.coef[expert]), float(entry.decay[expert])


def write_chunk(work: torch.Tensor, entry: PayloadEntry, row: int, projection,
                expert: int | None = None) -> None:
    """Apply ``entry``'s update to ``work``: trainer rows ``[row, row + len(work))``, all ``k``
    columns (of matrix ``expert`` of a stack), in place, with the rounding bits of flat indices
    ``(expert * d + row + i) * k + j``.

    The one call into the rgc core for writing an update. ``work`` is a whole chunk of the
    trainer's ``chunk_rows`` grid (any rows for a dense update), so the rebuild multiplies the
    same shapes as the trainer's step did.
    """
    offset = ((expert or 0) * entry.d + row) * entry.k
    rows = slice(row, row + work.shape[0])
    matrix = entry.values if entry.lowrank else entry.values.reshape(entry.d, entry.k)
    if expert is not None:
        matrix = matrix[expert]
    values = matrix[rows].to(work.device)
    coef, decay = _coefficients(entry, expert)
    if not entry.lowrank:
        apply_dense_update_(work, values, coef, decay=decay, seed=entry.seed,
                            stochastic_rounding=entry.stochastic_rounding, offset=offset)
        return
    if coef != 0.0 or decay != 0.0:
        apply_lowrank_update_(work, values, projection, coef, decay=decay,
                              seed=entry.seed, offset=offset, chunk_rows=work.shape[0],
                              stochastic_rounding=entry.stochastic_rounding)


def _chunks(row0: int, rows: int, entry: PayloadEntry):
    """``(trainer row of the chunk, its row count, first row of the block in it, rows of the
    block in it)`` over the trainer's chunk grid, for the block of trainer rows
    ``[row0, row0 + rows)`` (of one matrix of a stack). A dense update is elementwise (any
    chunks give the same bits): chunks of about ``_DENSE_CHUNK`` elements."""
    step = entry.chunk_rows if entry.lowrank else max(1, _DENSE_CHUNK // entry.k)
    end = row0 + rows
    start = row0 - row0 % step
    while start < end:
        stop = min(start + step, entry.d)
        lo, hi = max(start, row0), min(stop, end)
        yield start, stop - start, lo, hi - lo
        start = stop


class Receiver:
    """The rgc state of one engine worker: the weights it updates and the pending payload.

    ``model`` is the worker's ``nn.Module`` (``worker.model_runner.model``).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.step: int | None = None  # the last step applied; None after a full load
        self.pending: tuple[int, list[tuple[PayloadEntry, Piece | ExpertPieces]]] | None = None
        self._pieces: dict[str, Piece | ExpertPieces] = {}

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters(remove_duplicate=False))

    def piece(self, name: str) -> Piece | ExpertPieces:
        if name not in self._pieces:
            try:
                self._pieces[name] = locate(self.model, name)
            except KeyError as e:
                raise PayloadError(f"{e.args[0]}; the engine must serve the trainer's model "
                                   "architecture") from None
        return self._pieces[name]

    def _checked_piece(self, entry: PayloadEntry, params) -> Piece | ExpertPieces:
        piece = self.piece(entry.name)
        param = params[piece.param]
        stacked = isinstance(piece, ExpertPieces)
        if stacked != (entry.stack is not None):
            held = "a stack of experts" if stacked else "one matrix"
            sent = "a stack of experts" if entry.stack is not None else "one matrix"
            raise PayloadError(f"{entry.name!r}: the payload updates {sent} but the engine "
                               f"holds {held}; the engine must serve the trainer's model "
                               "architecture")
        if stacked and entry.stack.count != piece.count:
            raise PayloadError(f"{entry.name!r}: the payload updates {entry.stack.count} "
                               f"experts but the engine's layer has {piece.count}")
        if param.numel() == 0:
            raise PayloadError(
                f"the engine's {piece.param!r} is empty: its backend repacked the weights "
                "after loading (vLLM on a CPU does). Start the engine with worker_extension_cls="
                "'rgc.integrations.vllm.RGCWorkerExtension', which keeps them plain")
        if param.dtype != entry.dtype:
            raise PayloadError(f"{entry.name!r}: the update was made for {entry.dtype} weights "
                               f"but the engine's are {param.dtype}; start the engine with "
                               "the trainer's dtype")
        if (piece.d, piece.k) != (entry.d, entry.k):
            raise PayloadError(f"{entry.name!r}: the payload's update is {entry.d} x {entry.k} "
                               f"but the engine's tensor is {piece.d} x {piece.k}")
        return piece

    def _projection(self, entry: PayloadEntry, device, dtype):
        if not entry.lowrank:
            return None
        spec = entry.projection
        return make_projection(spec.kind, spec.k, spec.r, seed=spec.seed, device=device,
                               dtype=dtype)

    @torch.no_grad()
    def _pass_stack(self, entry: PayloadEntry, pieces: ExpertPieces, params, *, write: bool,
                    base: list[int] | None = None) -> list[int]:
        """:meth:`_pass` for a stack of experts: each block's share (``base``: the shares as
        the blocks are now, returned for experts the update leaves unchanged)."""
        weight = params[pieces.param]
        projection = self._projection(entry, weight.device, weight.dtype)
        shares = []
        for i, block in enumerate(pieces.blocks):
            e = block.expert
            key = pieces.key(block)
            if _coefficients(entry, e) == (0.0, 0.0):  # the trainer left it bit-identical
                shares.append(base[i] if base is not None else piece_fingerprint(
                    pieces.get(params, block), key[0], block.col0, entry.k))
                continue
            share = 0
            for row, n, lo, m in _chunks(block.row0, block.rows, entry):
                work = torch.zeros(n, entry.k, dtype=weight.dtype, device=weight.device)
                part = work[lo - row:lo - row + m, block.col0:block.col0 + block.cols]
                part.copy_(pieces.get(params, block, lo - block.row0, m))
                write_chunk(work, entry, row, projection, expert=e)
                if write:
                    pieces.put(params, block, lo - block.row0, part)
                else:
                    share += piece_fingerprint(part, e * entry.d + lo, block.col0, entry.k)
            if write:
                share = piece_fingerprint(pieces.get(params, block), key[0], block.col0,
                                          entry.k)
            shares.append(share)
        return shares

    def _shares(self, piece: Piece | ExpertPieces, params) -> list[tuple[tuple, int]]:
        """``[(key, fingerprint share)]`` of the blocks of ``piece`` as they are now."""
        if isinstance(piece, ExpertPieces):
            return [(piece.key(b), piece_fingerprint(piece.get(params, b), piece.key(b)[0],
                                                     b.col0, piece.k))
                    for b in piece.blocks]
        return [(piece.key, piece_fingerprint(piece.view(params), piece.row0, piece.col0,
                                              piece.k))]

    @torch.no_grad()
    def _pass(self, entry: PayloadEntry, piece: Piece, params, *, write: bool) -> int:
        """Replay ``entry`` on ``piece``: into a scratch buffer (``write=False``; returns the
        share of the fingerprint the piece would have) or in place (returns the new share)."""
        view = piece.view(params)
        projection = self._projection(entry, view.device, view.dtype)
        share = 0
        for row, n, lo, m in _chunks(piece.row0, piece.rows, entry):
            local = view[lo - piece.row0:lo - piece.row0 + m]
            if write and (n, piece.cols) == (m, entry.k):
                write_chunk(local, entry, row, projection)
                continue
            work = torch.zeros(n, entry.k, dtype=view.dtype, device=view.device)
            part = work[lo - row:lo - row + m, piece.col0:piece.col0 + piece.cols]
            part.copy_(local)
            write_chunk(work, entry, row, projection)
            if write:
                local.copy_(part)
            else:
                share += piece_fingerprint(part, lo, piece.col0, entry.k)
        if write:
            share = piece_fingerprint(view, piece.row0, piece.col0, entry.k)
        return share

    def prepare(self, payload: dict[str, torch.Tensor]) -> dict:
        """Check ``payload`` and compute, without writing, each piece's fingerprint shares.

        Returns ``{"step", "last_step", "shares": {name: [[key, base share, new share],
        ...]}}`` (one item per block: a stack of experts has several); the payload stays
        pending until :meth:`commit` or :meth:`discard`.
        """
        self.pending = None
        decoded = decode(payload)
        step = decoded.step
        for entry in decoded.entries:
            _check_supported(entry)
        if self.step is not None and step != self.step + 1:
            raise PayloadError(f"wrong step order: the engine applied step {self.step} last, "
                               f"this payload is step {step} (expected {self.step + 1}); send "
                               "the missing payloads in order, or resend the weights with "
                               "push_weights")
        params = self.params()
        planned = [(e, self._checked_piece(e, params)) for e in decoded.entries]
        shares = {}
        for entry, piece in planned:
            base = self._shares(piece, params)
            if isinstance(piece, ExpertPieces):
                new = self._pass_stack(entry, piece, params, write=False,
                                       base=[s for _, s in base])
            else:
                new = [self._pass(entry, piece, params, write=False)]
            shares[entry.name] = [[list(key), b, n] for (key, b), n in zip(base, new,
                                                                          strict=True)]
        self.pending = (step, planned)
        return {"step": step, "last_step": self.step, "shares": shares}

    def commit(self, step: int) -> dict:
        """Write the pending payload of ``step``; returns ``{"shares": {name: [[key, share],
        ...]}}`` of the written blocks."""
        if self.pending is None or self.pending[0] != step:
            raise PayloadError(f"no prepared payload of step {step} to commit")
        _, planned = self.pending
        self.pending = None
        params = self.params()
        shares = {}
        for entry, piece in planned:
            if isinstance(piece, ExpertPieces):
                written = zip([piece.key(b) for b in piece.blocks],
                              self._pass_stack(entry, piece, params, write=True), strict=True)
            else:
                written = [(piece.key, self._pass(entry, piece, params, write=True))]
            shares[entry.name] = [[list(key), share] for key, share in written]
        self.step = step
        return {"shares": shares}

    def discard(self) -> None:
        self.pending = None

    def fingerprints(self, names) -> dict:
        """``{name: [[key, share], ...]}`` of the engine's current blocks."""
        params = self.params()
        return {name: [[list(key), share] for key, share in self._shares(self.piece(name),
                                                                         params)]
                for name in names}

    def read(self, names) -> dict[str, list[tuple[list[int], torch.Tensor]]]:
        """``{name: [([row0, rows, col0, cols, d, k], a CPU copy of the block), ...]}``; a
        stack of experts is the ``[E d, k]`` matrix of its experts' ``d x k`` matrices."""
        params = self.params()
        out = {}
        for name in names:
            p = self.piece(name)
            if isinstance(p, ExpertPieces):
                out[name] = [([*p.key(b), p.count * p.d, p.k],
                              p.get(params, b).detach().cpu().clone()) for b in p.blocks]
            else:
                out[name] = [([*p.key, p.d, p.k], p.view(params).detach().cpu().clone())]
        return out

    def _packed_experts(self) -> list[tuple[torch.Tensor, object]]:
        """``[(weight, packing)]`` of the fused-MoE weights stored in a packed order."""
        try:
            from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        except ImportError:
            return []
        out = []
        for module in self.model.modules():
            if not isinstance(module, RoutedExperts):
                continue
            try:
                packing = expert_packing(module)
            except KeyError:
                continue  # a layout rgc does not know: loaded as vLLM loads it
            if packing is not None:
                out += [(getattr(module, n).data, packing) for n in ("w13_weight", "w2_weight")]
        return out

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor], step: int | None) -> None:
        """Load full trainer tensors through the model's own weight loader; forget any
        pending payload; the next payload must be step ``step + 1`` (any step for None).

        The loader writes expert weights in plain order, so packed fused-MoE weights are
        unpacked around the load and packed again after it."""
        self.pending = None
        device = next(self.model.parameters()).device
        packed = self._packed_experts()
        for weight, packing in packed:
            packing.unpack_(weight)
        try:
            self.model.load_weights((n, t.to(device)) for n, t in weights.items())
        finally:
            for weight, packing in packed:
                packing.pack_(weight)
        self.step = step
