"""The trainer side: send a payload or the full weights to a vLLM engine and check the result.

``engine`` is a ``vllm.LLM`` (in this process, or with worker processes) or the base URL of a
``vllm serve`` started with ``--worker-extension-cls rgc.integrations.vllm.RGCWorkerExtension``
and ``VLLM_SERVER_DEV_MODE=1`` (its ``/collective_rpc`` and ``/reset_prefix_cache``
endpoints). How the tensors travel:

* a single worker in this process: the dict itself, nothing is copied;
* worker processes on this host: one safetensors file in shared memory (``/dev/shm``) that
  every rank reads, removed afterwards;
* a server: the safetensors bytes as base64 text in the request.

The engine's ranks answer with their shares of each tensor's fingerprint; this side adds
them up (:func:`rgc.integrations.vllm.layout.combine`) and compares with the payload.
"""

from __future__ import annotations

import base64
import json
import os
import tempfile
import urllib.request
import weakref

import torch
import torch.nn as nn

from rgc.integrations.vllm.extension import INLINE_PREFIX, RGCWorkerExtension
from rgc.integrations.vllm.layout import combine
from rgc.payload import decode, fingerprint, payload_nbytes

_EXTENSION = "rgc.integrations.vllm.RGCWorkerExtension"
_RESYNC = "Resend the full weights with rgc.integrations.vllm.push_weights(engine, model)"


class Engine:
    """How to reach the rgc receiver of one engine (see the module docs)."""

    def __init__(self, engine):
        self.url = engine.rstrip("/") if isinstance(engine, str) else None
        self.llm = None if self.url else engine
        self.worker = None
        if self.llm is not None:
            executor = getattr(self.llm.llm_engine, "model_executor", None)
            wrapper = getattr(executor, "driver_worker", None)
            if wrapper is not None and getattr(executor, "world_size", 1) == 1:
                self.worker = getattr(wrapper, "worker", wrapper)
        if self.worker is None:
            replies = self._call("rgc_hello")
            if not replies or not all(isinstance(r, dict) and "pid" in r for r in replies):
                raise RuntimeError(f"the engine answered {replies!r} to rgc_hello")

    @property
    def local(self) -> bool:
        """True when the only worker runs in this process (tensors are passed as they are)."""
        return self.worker is not None

    def _call(self, method: str, *args) -> list:
        try:
            if self.url is not None:
                return self._post("/collective_rpc", {"method": method, "args": list(args)})[
                    "results"]
            return self.llm.collective_rpc(method, args=args)
        except Exception as e:
            if isinstance(e, AttributeError) or f"no attribute '{method}'" in str(e):
                raise RuntimeError(
                    f"the engine has no rgc receiver ({type(e).__name__}: {e}); start it with "
                    f"worker_extension_cls={_EXTENSION!r} (vllm serve: --worker-extension-cls "
                    f"{_EXTENSION}, with VLLM_SERVER_DEV_MODE=1)") from e
            raise

    def _post(self, path: str, body: dict | None = None):
        data = json.dumps(body or {}).encode()
        request = urllib.request.Request(self.url + path, data=data, method="POST",
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request) as response:
            text = response.read()
        return json.loads(text) if text else None

    def call(self, method: str, *args) -> list:
        """Run ``RGCWorkerExtension.<method>`` on every rank; raise a refusal as
        ``ValueError`` (after dropping any prepared payload)."""
        if self.local:
            replies = [getattr(RGCWorkerExtension, method)(self.worker, *args)]
        else:
            replies = self._call(method, *args)
        errors = sorted({r["error"] for r in replies if isinstance(r, dict) and "error" in r})
        if errors:
            if method != "rgc_discard":
                self.call("rgc_discard")
            raise ValueError("the engine refused the request, nothing was changed: "
                             + "; ".join(errors))
        return replies

    def send(self, tensors: dict[str, torch.Tensor]):
        """``(argument that names the tensors for the workers, bytes sent, clean-up)``."""
        if self.local:
            return tensors, payload_nbytes(tensors), lambda: None
        from safetensors.torch import save, save_file

        cpu = {n: t.detach().to("cpu").contiguous() for n, t in tensors.items()}
        if self.url is not None:
            text = INLINE_PREFIX + base64.b64encode(save(cpu)).decode()
            return text, len(text), lambda: None
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="rgc-", suffix=".safetensors", dir=folder)
        os.close(fd)
        save_file(cpu, path)
        return path, os.path.getsize(path), lambda: os.remove(path)

    def reset_prefix_cache(self) -> None:
        if self.url is not None:
            self._post("/reset_prefix_cache")
        else:
            self.llm.reset_prefix_cache()


_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_URL_ENGINES: dict[str, Engine] = {}


def engine_of(engine) -> Engine:
    """The (cached) :class:`Engine` handle of a ``vllm.LLM`` or a server URL."""
    if isinstance(engine, Engine):
        return engine
    cache = _URL_ENGINES if isinstance(engine, str) else _ENGINES
    if engine not in cache:
        cache[engine] = Engine(engine)
    return cache[engine]


def _combined(replies: list, field_index: int, dims: dict[str, tuple[int, int]]):
    """``{name: fingerprint}`` from the ranks' ``{"shares": {name: [[key, share...], ...]}}``
    (one item per block a rank holds)."""
    names = replies[0]["shares"].keys()
    return {n: combine([(item[0], item[field_index]) for r in replies for item in r["shares"][n]],
                       *dims[n], n) for n in names}


def _entry_dims(entry) -> tuple[int, int]:
    """``(rows, k)`` of the matrix an entry's fingerprint covers (``E d`` for a stack)."""
    return (entry.d * (entry.stack.count if entry.stack is not None else 1), entry.k)


def push_update(engine, payload: dict[str, torch.Tensor]) -> int:
    """Apply ``payload`` (``optimizer.export_update(model)``) to the engine's weights.

    The engine checks the payload and computes what each tensor's fingerprint would become
    before writing anything; here the shares of all ranks are compared with the payload's
    ``N/base`` (the engine holds the trainer's weights before the step) and ``N/result``
    (the engine reproduces the trainer's bits). A refused payload raises ``ValueError`` and
    one the engine would not reproduce ``RuntimeError``, both with the engine's weights
    unchanged. After the write the prefix cache is reset. Returns the bytes sent.
    """
    entries = {e.name: e for e in decode(payload).entries}
    handle = engine_of(engine)
    source, nbytes, cleanup = handle.send(payload)
    try:
        replies = handle.call("rgc_prepare", source)
    finally:
        cleanup()
    step = replies[0]["step"]
    dims = {n: _entry_dims(entries[n]) for n in replies[0]["shares"]}
    try:
        base, new = _combined(replies, 1, dims), _combined(replies, 2, dims)
    except RuntimeError:
        handle.call("rgc_discard")
        raise
    stale = sorted(n for n in base if base[n] != entries[n].base)
    if stale:
        handle.call("rgc_discard")
        raise ValueError(f"the engine's {stale} are not the tensors step {step} was computed "
                         "from (fingerprint mismatch): a step was missed, repeated or "
                         f"reordered, or the engine started from other weights; nothing was "
                         f"changed. {_RESYNC}")
    diverged = sorted(n for n in new if new[n] != entries[n].result)
    if diverged:
        handle.call("rgc_discard")
        raise RuntimeError(f"the engine would compute other bits than the trainer for "
                           f"{diverged} at step {step} (another device type, or another rgc or "
                           f"torch build); nothing was changed. {_RESYNC}, and from then on "
                           "after every step")
    written = _combined(handle.call("rgc_commit", step), 1, dims)
    handle.reset_prefix_cache()
    wrong = sorted(n for n in written if written[n] != entries[n].result)
    if wrong:
        raise RuntimeError(f"after writing step {step} the engine's {wrong} differ from the "
                           f"trainer's although the check pass agreed (non-deterministic "
                           f"arithmetic). {_RESYNC}")
    return nbytes


def _dims(t: torch.Tensor) -> tuple[int, int]:
    return (t.shape[0], t[0].numel()) if t.dim() else (1, 1)


def push_weights(engine, model: nn.Module, *, step: int | None = None) -> int:
    """Load every tensor of ``model.state_dict()`` into the engine through vLLM's own weight
    loader (a full resync: after a restart, a missed step or a refused payload).

    The engine's fingerprints of the loaded tensors must then equal the trainer's, or
    ``RuntimeError`` is raised. ``step``: the trainer's optimizer step the weights are at
    (the next payload must be ``step + 1``); ``None`` accepts any next step (its ``N/base``
    fingerprints still guard it). Resets the prefix cache. Returns the bytes sent.
    """
    handle = engine_of(engine)
    weights = {n: t.detach() for n, t in model.state_dict().items()}
    source, nbytes, cleanup = handle.send(weights)
    try:
        replies = handle.call("rgc_load", source, step)
    finally:
        cleanup()
    handle.reset_prefix_cache()
    dims = {n: _dims(weights[n]) for n in replies[0]["shares"]}
    got = _combined(replies, 1, dims)
    wrong = sorted(n for n in got if got[n] != fingerprint(weights[n]))
    if wrong:
        raise RuntimeError(f"after loading the full weights the engine's {wrong} differ from "
                           "the trainer's: the engine transforms weights on load (quantized or "
                           "repacked layers), which rgc cannot update")
    return nbytes


def read_weights(engine, names) -> dict[str, torch.Tensor]:
    """The engine's current values of the trainer tensors ``names``, reassembled from the
    ranks' pieces (fused layers split, shards joined) as CPU tensors of shape ``d x k``
    (``d`` for 1-D tensors, ``E d x k`` for a stack of ``E`` experts)."""
    handle = engine_of(engine)
    names = list(names)
    if handle.local:
        replies = handle.call("rgc_read", names)
    else:
        from safetensors.torch import load_file

        folder = tempfile.mkdtemp(prefix="rgc-read-")
        try:
            replies = []
            for reply in handle.call("rgc_read", names, os.path.join(folder, "pieces")):
                tensors = load_file(reply["path"])
                replies.append({n: [(key, tensors[f"{n}#{i}"]) for i, key in enumerate(keys)]
                                for n, keys in reply["keys"].items()})
        finally:
            for file in os.listdir(folder):
                os.remove(os.path.join(folder, file))
            os.rmdir(folder)
    out = {}
    for name in names:
        full = None
        for reply in replies:
            for (row0, rows, col0, cols, d, k), piece in reply[name]:
                if full is None:
                    full = torch.empty(d, k, dtype=piece.dtype)
                full[row0:row0 + rows, col0:col0 + cols] = piece
        out[name] = full.reshape(-1) if full.shape[1] == 1 else full
    return out
