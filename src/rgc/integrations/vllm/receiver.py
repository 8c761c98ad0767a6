"""The engine side: read a payload, check it, replay it on the engine's own weight pieces.

One payload is applied in two passes over the same arithmetic, so that a payload the engine
cannot reproduce leaves its weights as they were:

1. :meth:`Receiver.prepare`: validate every entry (format, checksum, names, shapes, dtypes,
   finite values), fingerprint each piece as it is (``base``) and as the update would leave
   it (``new``), computed ``chunk_rows`` rows at a time in a scratch buffer; nothing is
   written. The trainer adds the shares of all ranks and compares them with the payload's
   ``N/base`` and ``N/result``.
2. :meth:`Receiver.commit`: write the update in place and fingerprint the result again.

:func:`write_chunk` is the one place that calls the rgc core to write an update.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from rgc.integrations.vllm.layout import Piece, locate, piece_fingerprint
from rgc.payload import PayloadEntry, PayloadError, decode
from rgc.projection import make_projection
from rgc.updates import apply_dense_update_, apply_lowrank_update_

_DENSE_CHUNK = 1 << 22


def _check_supported(entry: PayloadEntry) -> None:
    """Refuse what this receiver does not write: stacks of experts, 0-dim parameters."""
    if entry.stack is not None:
        raise PayloadError(
            f"payload entry {entry.name!r} updates a stack of experts; vLLM keeps mixture-of-"
            "experts weights in its own fused layout, which this receiver does not write "
            "yet: resync those weights with push_weights(), or train the experts frozen")
    if entry.values.dim() < 1:
        raise PayloadError(f"payload {entry.name!r}: the update must have at least one "
                           f"dimension, got shape {tuple(entry.values.shape)}")


def write_chunk(work: torch.Tensor, entry: PayloadEntry, row: int, projection) -> None:
    """Apply ``entry``'s update to ``work``: trainer rows ``[row, row + len(work))``, all ``k``
    columns, in place, with the rounding bits of flat indices ``row * k + i * k + j``.

    The one call into the rgc core for writing an update. ``work`` is a whole chunk of the
    trainer's ``chunk_rows`` grid (any rows for a dense update), so the rebuild multiplies the
    same shapes as the trainer's step did.
    """
    offset = row * entry.k
    rows = slice(row, row + work.shape[0])
    matrix = entry.values if entry.lowrank else entry.values.reshape(entry.d, entry.k)
    values = matrix[rows].to(work.device)
    if not entry.lowrank:
        apply_dense_update_(work, values, entry.coef, decay=entry.decay, seed=entry.seed,
                            stochastic_rounding=entry.stochastic_rounding, offset=offset)
        return
    if entry.coef != 0.0 or entry.decay != 0.0:
        apply_lowrank_update_(work, values, projection, entry.coef, decay=entry.decay,
                              seed=entry.seed, offset=offset, chunk_rows=work.shape[0],
                              stochastic_rounding=entry.stochastic_rounding)


def _chunks(piece: Piece, entry: PayloadEntry):
    """``(trainer row of the chunk, its row count, first row of the piece in it, rows of the
    piece in it)`` over the trainer's chunk grid. A dense update is elementwise (any chunks
    give the same bits): chunks of about ``_DENSE_CHUNK`` elements."""
    step = entry.chunk_rows if entry.lowrank else max(1, _DENSE_CHUNK // entry.k)
    end = piece.row0 + piece.rows
    start = piece.row0 - piece.row0 % step
    while start < end:
        stop = min(start + step, entry.d)
        lo, hi = max(start, piece.row0), min(stop, end)
        yield start, stop - start, lo, hi - lo
        start = stop


class Receiver:
    """The rgc state of one engine worker: the weights it updates and the pending payload.

    ``model`` is the worker's ``nn.Module`` (``worker.model_runner.model``).
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self.step: int | None = None  # the last step applied; None after a full load
        self.pending: tuple[int, list[tuple[PayloadEntry, Piece]]] | None = None
        self._pieces: dict[str, Piece] = {}

    def params(self) -> dict[str, torch.Tensor]:
        return dict(self.model.named_parameters(remove_duplicate=False))

    def piece(self, name: str) -> Piece:
        if name not in self._pieces:
            try:
                self._pieces[name] = locate(self.model, name)
            except KeyError as e:
                raise PayloadError(f"{e.args[0]}; the engine must serve the trainer's model "
                                   "architecture") from None
        return self._pieces[name]

    def _checked_piece(self, entry: PayloadEntry, params) -> Piece:
        piece = self.piece(entry.name)
        param = params[piece.param]
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
    def _pass(self, entry: PayloadEntry, piece: Piece, params, *, write: bool) -> int:
        """Replay ``entry`` on ``piece``: into a scratch buffer (``write=False``; returns the
        share of the fingerprint the piece would have) or in place (returns the new share)."""
        view = piece.view(params)
        projection = self._projection(entry, view.device, view.dtype)
        share = 0
        for row, n, lo, m in _chunks(piece, entry):
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

        Returns ``{"step", "last_step", "shares": {name: [key, base share, new share]}}``;
        the payload stays pending until :meth:`commit` or :meth:`discard`.
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
            base = piece_fingerprint(piece.view(params), piece.row0, piece.col0, entry.k)
            shares[entry.name] = [list(piece.key), base,
                                  self._pass(entry, piece, params, write=False)]
        self.pending = (step, planned)
        return {"step": step, "last_step": self.step, "shares": shares}

    def commit(self, step: int) -> dict:
        """Write the pending payload of ``step``; returns ``{"shares": {name: [key, share]}}``
        of the written pieces."""
        if self.pending is None or self.pending[0] != step:
            raise PayloadError(f"no prepared payload of step {step} to commit")
        _, planned = self.pending
        self.pending = None
        params = self.params()
        shares = {e.name: [list(p.key), self._pass(e, p, params, write=True)]
                  for e, p in planned}
        self.step = step
        return {"shares": shares}

    def discard(self) -> None:
        self.pending = None

    def fingerprints(self, names) -> dict:
        """``{name: [key, share, d, k]}`` of the engine's current pieces."""
        params = self.params()
        out = {}
        for name in names:
            piece = self.piece(name)
            out[name] = [list(piece.key), piece_fingerprint(piece.view(params), piece.row0,
                                                            piece.col0, piece.k),
                         piece.d, piece.k]
        return out

    def read(self, names) -> dict[str, tuple[list[int], torch.Tensor]]:
        """``{name: ([row0, rows, col0, cols, d, k], a CPU copy of the piece)}``."""
        params = self.params()
        out = {}
        for name in names:
            p = self.piece(name)
            out[name] = ([*p.key, p.d, p.k], p.view(params).detach().cpu().clone())
        return out

    @torch.no_grad()
    def load(self, weights: dict[str, torch.Tensor], step: int | None) -> None:
        """Load full trainer tensors through the model's own weight loader; forget any
        pending payload; the next payload must be step ``step + 1`` (any step for None)."""
        self.pending = None
        device = next(self.model.parameters()).device
        self.model.load_weights((n, t.to(device)) for n, t in weights.items())
        self.step = step
