"""The engine side: read a payload, check it, replay it on the engine's own weight pieces.

A payload is applied so that one the engine cannot reproduce leaves its weights as they were:

1. :meth:`Receiver.prepare`: validate every entry (format, checksum, names, shapes, dtypes,
   finite values); then, :class:`Stretch` by stretch of each piece, copy the engine's values
   into a scratch buffer, fingerprint them (``base``), replay the update on the copy and
   fingerprint the result (``new``). Nothing is written. The results are kept for the commit
   up to ``Receiver.keep_bytes`` in all. The trainer adds the shares of all ranks and
   compares them with the payload's ``N/base`` and ``N/result``.
2. :meth:`Receiver.commit`: copy each kept result in (the bits that were checked); a stretch
   not kept is replayed again in place and the written values fingerprinted.

A stretch is rebuilt on the trainer's grid of ``chunk_rows`` rows, so the rebuild multiplies
the same shapes as the trainer's step did: whole chunks of a full-width block at once (up to
about ``_SPAN`` elements), one chunk at a time (in a scratch chunk of the trainer's width) where
the engine holds part of a chunk (a column shard, a row shard off the grid). A stack of experts
(:class:`~rgc.integrations.vllm.layout.ExpertPieces`) whose engine parameter is the trainer's
whole ``[E, d, k]`` stack is rebuilt a group of experts at a time, read from and written to
the engine's storage order with one gather and one scatter; otherwise block by block, with the
rounding bits of flat index ``(e d + i) k + j``. No ``[E, d, k]`` FP32 temporary is made.

:func:`write_chunk` is the one place that calls the rgc core to write an update.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn as nn

from rgc.integrations.vllm.layout import (
    ExpertBlock,
    ExpertPieces,
    Piece,
    expert_packing,
    locate,
    piece_fingerprint,
)
from rgc.payload import PayloadEntry, PayloadError, decode
from rgc.projection import make_projection
from rgc.updates import apply_dense_update_, apply_lowrank_update_

#: Elements of a dense (direction) update written at once, and of a stretch rebuilt at once.
_DENSE_CHUNK = 1 << 22
_SPAN = 1 << 24
#: Bytes of rebuilt values a receiver keeps between prepare and commit (``RGC_KEEP_BYTES``).
KEEP_BYTES = int(os.environ.get("RGC_KEEP_BYTES", 1 << 30))


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


def _coefficients(entry: PayloadEntry, experts: int | range | None):
    """``(coef, decay)`` of ``entry``: floats for one matrix (matrix ``experts`` of a stack),
    FP32 ``[len(experts)]`` tensors for a range of a stack (the decay 0.0 if all zero)."""
    if experts is None:
        return entry.coef, entry.decay
    if isinstance(experts, int):
        return float(entry.coef[experts]), float(entry.decay[experts])
    part = slice(experts.start, experts.stop)
    decay = entry.decay[part]
    return (entry.coef[part].to(torch.float32),
            decay.to(torch.float32) if bool(decay.ne(0).any()) else 0.0)


def write_chunk(work: torch.Tensor, entry: PayloadEntry, row: int, projection,
                experts: int | range | None = None) -> None:
    """Apply ``entry``'s update to ``work`` in place: trainer rows ``[row, row + len(work))``,
    all ``k`` columns, of the matrix (matrix ``experts`` of a stack), or with a range of
    ``experts`` the whole ``[len(experts), d, k]`` matrices of those experts (``row`` 0); the
    rounding bits of flat indices ``(e d + row + i) k + j``.

    The one call into the rgc core for writing an update. ``work`` starts on the trainer's
    grid of ``chunk_rows`` rows and holds whole chunks of it (any rows for a dense update), so
    the rebuild multiplies the same shapes as the trainer's step did.
    """
    first = experts.start if isinstance(experts, range) else experts or 0
    offset = (first * entry.d + row) * entry.k
    rows = slice(row, row + work.shape[-2])
    matrix = entry.values if entry.lowrank else entry.values.reshape(entry.d, entry.k)
    if isinstance(experts, range):
        matrix = matrix[experts.start:experts.stop]
    elif experts is not None:
        matrix = matrix[experts]
    values = matrix[..., rows, :].to(work.device)
    coef, decay = _coefficients(entry, experts)
    if not entry.lowrank:
        apply_dense_update_(work, values, coef, decay=decay, seed=entry.seed,
                            stochastic_rounding=entry.stochastic_rounding, offset=offset)
        return
    if torch.is_tensor(coef) or coef != 0.0 or decay != 0.0:
        apply_lowrank_update_(work, values, projection, coef, decay=decay,
                              seed=entry.seed, offset=offset, chunk_rows=entry.chunk_rows,
                              stochastic_rounding=entry.stochastic_rounding)


@dataclass(frozen=True)
class Stretch:
    """What the receiver rebuilds in one call: trainer rows ``[row, row + n)`` (whole chunks
    of the trainer's grid) of the matrix, of which the engine holds rows ``[lo, lo + m)`` x
    columns ``[col0, col0 + cols)``. ``block``: that of one expert of a stack; ``experts``: a
    range of experts of a :meth:`~ExpertPieces.whole` stack, whole matrices (``row`` and
    ``lo`` 0, ``n`` and ``m`` ``d``)."""

    row: int
    n: int
    lo: int
    m: int
    col0: int
    cols: int
    block: ExpertBlock | None = None
    experts: range | None = None

    def key(self, d: int) -> tuple[int, int, int, int]:
        """The block of the trainer's ``[E d, k]`` matrix (``d x k`` for one) it holds."""
        first = (self.experts.start if self.experts is not None
                 else self.block.expert if self.block is not None else 0)
        count = len(self.experts) if self.experts is not None else 1
        return first * d + self.lo, count * self.m, self.col0, self.cols

    @property
    def matrices(self) -> int | range | None:
        """The ``experts`` argument of :func:`write_chunk`."""
        return self.experts if self.experts is not None else (
            None if self.block is None else self.block.expert)


def _cover(lo0: int, rows: int, col0: int, cols: int, d: int, k: int, step: int, span: int,
           block: ExpertBlock | None = None) -> list[Stretch]:
    """The stretches of a block of rows ``[lo0, lo0 + rows)`` x columns ``[col0, col0 +
    cols)`` on the trainer's grid of ``step`` rows: the chunks a full-width block fills,
    ``span`` rows (a multiple of ``step``) at a time, and one stretch per chunk the block
    holds part of."""
    end = lo0 + rows
    a = b = lo0
    if cols == k:
        a, b = -(-lo0 // step) * step, end if end == d else end - end % step
        a, b = (a, b) if a < b else (lo0, lo0)

    def chunks(x, y):
        start = x - x % step
        while start < y:
            stop = min(start + step, d)
            lo, hi = max(start, x), min(stop, y)
            yield Stretch(start, stop - start, lo, hi - lo, col0, cols, block)
            start = stop

    whole = [Stretch(r, min(r + span, b) - r, r, min(r + span, b) - r, col0, cols, block)
             for r in range(a, b, span)]
    return [*chunks(lo0, a), *whole, *chunks(b, end)]


def stretches(piece: Piece | ExpertPieces, params, entry: PayloadEntry | None = None
              ) -> list[Stretch]:
    """The stretches ``piece`` is rebuilt in for ``entry`` (on its grid), or read in for a
    fingerprint (``entry`` None: whole blocks)."""
    step = span = 1 << 62
    if entry is not None:
        step = entry.chunk_rows if entry.lowrank else max(1, _DENSE_CHUNK // entry.k)
        span = max(1, _SPAN // (step * piece.k)) * step
    if isinstance(piece, Piece):
        return _cover(piece.row0, piece.rows, piece.col0, piece.cols, piece.d, piece.k,
                      step, span)
    d, k = piece.d, piece.k
    if piece.whole(params):
        group = max(1, _SPAN // (d * k))
        return [Stretch(0, d, 0, d, 0, k, experts=range(e, min(e + group, piece.count)))
                for e in range(0, piece.count, group)]
    return [s for b in piece.blocks
            for s in _cover(b.row0, b.rows, b.col0, b.cols, d, k, step, span, b)]


def _read(piece: Piece | ExpertPieces, s: Stretch, params) -> torch.Tensor:
    """A contiguous copy of the engine's values of stretch ``s``: ``[m, cols]``, or ``[g, d,
    k]`` for a range of experts."""
    if s.experts is not None:
        return piece.get_experts(params, s.experts)
    if s.block is not None:
        values = piece.get(params, s.block, s.lo - s.block.row0, s.m)
    else:
        values = piece.view(params)[s.lo - piece.row0:s.lo - piece.row0 + s.m]
    return values.clone() if values._is_view() else values


def _write(piece: Piece | ExpertPieces, s: Stretch, params, values: torch.Tensor) -> None:
    """Store ``values`` (as :func:`_read` gives them) as the engine's values of ``s``."""
    if s.experts is not None:
        piece.put_experts(params, s.experts, values)
    elif s.block is not None:
        piece.put(params, s.block, s.lo - s.block.row0, values)
    else:
        piece.view(params)[s.lo - piece.row0:s.lo - piece.row0 + s.m].copy_(values)


def _share(piece: Piece | ExpertPieces, s: Stretch, values: torch.Tensor) -> int:
    """The fingerprint share of ``values`` of stretch ``s``."""
    row0, _, col0, cols = s.key(piece.d)
    return piece_fingerprint(values.reshape(-1, cols), row0, col0, piece.k)


def _rebuild(entry: PayloadEntry, s: Stretch, old: torch.Tensor, projection) -> torch.Tensor:
    """The values of stretch ``s`` after ``entry``'s update, from its values ``old`` (as
    :func:`_read` gives them; consumed)."""
    if (s.n, s.cols) == (s.m, entry.k):
        write_chunk(old, entry, s.row, projection, s.matrices)
        return old
    work = torch.zeros(s.n, entry.k, dtype=old.dtype, device=old.device)
    part = work[s.lo - s.row:s.lo - s.row + s.m, s.col0:s.col0 + s.cols]
    part.copy_(old)
    write_chunk(work, entry, s.row, projection, s.matrices)
    return part


class Receiver:
    """The rgc state of one engine worker: the weights it updates and the pending payload.

    ``model`` is the worker's ``nn.Module`` (``worker.model_runner.model``); ``keep_bytes``:
    how much of a prepared payload's rebuilt values is kept for its commit (the rest is
    rebuilt again at the commit).
    """

    def __init__(self, model: nn.Module, keep_bytes: int = KEEP_BYTES):
        self.model = model
        self.keep_bytes = keep_bytes
        self.step: int | None = None  # the last step applied; None after a full load
        # (step, [(entry, piece, stretches, kept values or None per stretch, new shares)])
        self.pending: tuple[int, list[tuple]] | None = None
        self._pieces: dict[str, Piece | ExpertPieces] = {}
        # projections of the last payload, and of the one being applied
        self._kept_projections: dict[tuple, torch.Tensor] = {}
        self._used: dict[tuple, torch.Tensor] = {}

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

    def _projection(self, entry: PayloadEntry, params, piece):
        """``P`` (``k x r``, the weight's dtype and device) of a low-rank ``entry``; made once
        per payload and kept for the next one (a trainer keeps ``P`` for many steps)."""
        if not entry.lowrank:
            return None
        spec, weight = entry.projection, params[piece.param]
        key = (spec, weight.dtype, weight.device)
        if key not in self._used:
            self._used[key] = self._kept_projections.get(key)
            if self._used[key] is None:
                self._used[key] = make_projection(spec.kind, spec.k, spec.r, seed=spec.seed,
                                                  device=weight.device, dtype=weight.dtype)
        return self._used[key]

    @torch.no_grad()
    def prepare_piece(self, entry: PayloadEntry, piece: Piece | ExpertPieces, params,
                      budget: int | None = None) -> tuple[list, list]:
        """Replay ``entry`` on copies of ``piece``'s stretches, writing nothing: ``([(key,
        base share, new share)], [rebuilt values, or None past ``budget`` bytes])``."""
        budget = self.keep_bytes if budget is None else budget
        projection = self._projection(entry, params, piece)
        shares, kept = [], []
        for s in stretches(piece, params, entry):
            old = _read(piece, s, params)
            base = _share(piece, s, old)
            new = _rebuild(entry, s, old, projection)
            shares.append((s.key(piece.d), base, _share(piece, s, new)))
            size = new.untyped_storage().nbytes()
            kept.append(new if size <= budget else None)
            budget -= size if size <= budget else 0
        return shares, kept

    @torch.no_grad()
    def commit_piece(self, entry: PayloadEntry, piece: Piece | ExpertPieces, params,
                     kept: list) -> list[tuple[tuple, int | None]]:
        """Write ``entry``'s update into ``piece``: the ``kept`` values of
        :meth:`prepare_piece` as they are, the others rebuilt again; ``[(key, share of the
        written values or None where kept)]``."""
        projection = self._projection(entry, params, piece)
        written = []
        for s, new in zip(stretches(piece, params, entry), kept, strict=True):
            share = None
            if new is None:
                new = _rebuild(entry, s, _read(piece, s, params), projection)
                share = _share(piece, s, new)
            _write(piece, s, params, new)
            written.append((s.key(piece.d), share))
        return written

    def _shares(self, piece: Piece | ExpertPieces, params) -> list[tuple[tuple, int]]:
        """``[(key, fingerprint share)]`` of the blocks of ``piece`` as they are now."""
        return [(s.key(piece.d), _share(piece, s, _read(piece, s, params)))
                for s in stretches(piece, params)]

    def prepare(self, payload: dict[str, torch.Tensor]) -> dict:
        """Check ``payload`` and compute, without writing, each piece's fingerprint shares.

        Returns ``{"step", "last_step", "shares": {name: [[key, base share, new share],
        ...]}}`` (one item per stretch); the payload stays pending until :meth:`commit` or
        :meth:`discard`.
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
        self._kept_projections, self._used = self._used or self._kept_projections, {}
        shares, pending, budget = {}, [], self.keep_bytes
        for entry, piece in planned:
            items, kept = self.prepare_piece(entry, piece, params, budget)
            budget -= sum(v.untyped_storage().nbytes() for v in kept if v is not None)
            shares[entry.name] = [[list(key), b, n] for key, b, n in items]
            pending.append((entry, piece, kept, [n for _, _, n in items]))
        self.pending = (step, pending)
        return {"step": step, "last_step": self.step, "shares": shares}

    def commit(self, step: int) -> dict:
        """Write the pending payload of ``step``; returns ``{"shares": {name: [[key, share],
        ...]}}`` of the written stretches."""
        if self.pending is None or self.pending[0] != step:
            raise PayloadError(f"no prepared payload of step {step} to commit")
        _, pending = self.pending
        self.pending = None
        params = self.params()
        shares = {}
        for entry, piece, kept, new in pending:
            written = self.commit_piece(entry, piece, params, kept)
            shares[entry.name] = [[list(key), n if share is None else share]
                                  for (key, share), n in zip(written, new, strict=True)]
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
