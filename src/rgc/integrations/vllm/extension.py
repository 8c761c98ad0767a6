"""The worker extension: the calls the trainer makes into each vLLM worker.

vLLM mixes :class:`RGCWorkerExtension` into its worker class when the engine is started with
``worker_extension_cls="rgc.integrations.vllm.RGCWorkerExtension"`` (``vllm serve
--worker-extension-cls ...``); ``collective_rpc("rgc_...")`` then runs a method on every
rank. Arguments and results are plain values (strings, ints, lists, dicts), so that they
cross process boundaries and HTTP as they are; tensors travel as a file path (a file in
shared memory on one host) or, over HTTP, as base64 text.

A refused request returns ``{"error": message}`` instead of raising, so that the trainer
gets the message whatever transport carried it; :mod:`rgc.integrations.vllm.client` raises it.
"""

from __future__ import annotations

import base64
import os

import torch

from rgc.integrations.vllm.receiver import Receiver
from rgc.payload import PayloadError

INLINE_PREFIX = "base64:"


def load_tensors(source) -> dict[str, torch.Tensor]:
    """A dict of tensors from a dict (same process), a safetensors file path, or
    ``"base64:"`` + the base64 text of a safetensors file."""
    if isinstance(source, dict):
        return source
    from safetensors.torch import load, load_file

    if isinstance(source, str) and source.startswith(INLINE_PREFIX):
        return load(base64.b64decode(source[len(INLINE_PREFIX):]))
    if isinstance(source, str) and os.path.isfile(source):
        return load_file(source)
    raise PayloadError(f"cannot read tensors from {str(source)[:80]!r}: not a dict, a file on "
                       "the engine's host, or base64 text")


def _refusals(method):
    def call(self, *args):
        try:
            return method(self, *args)
        except PayloadError as e:
            return {"error": str(e)}
    call.__name__, call.__doc__ = method.__name__, method.__doc__
    return call


class RGCWorkerExtension:
    """rgc's receiver inside a vLLM worker (``worker_extension_cls``).

    Holds one :class:`~rgc.integrations.vllm.receiver.Receiver` per worker. Importing this
    module in the worker (vLLM does so before it loads the model) switches on the CPU
    workarounds of :mod:`rgc.integrations.vllm.cpu` when vLLM runs on a CPU.
    """

    def rgc_receiver(self) -> Receiver:
        """This worker's receiver (created on first use)."""
        receiver = getattr(self, "_rgc_receiver_state", None)
        if receiver is None:
            receiver = Receiver(self.model_runner.model)
            self._rgc_receiver_state = receiver
        return receiver

    def rgc_hello(self) -> dict:
        """Who answers: process id, rank, device of the weights."""
        device = next(self.model_runner.model.parameters()).device
        return {"pid": os.getpid(), "rank": int(getattr(self, "rank", 0)),
                "device": str(device)}

    @_refusals
    def rgc_prepare(self, source) -> dict:
        """Check a payload and return its fingerprint shares; see ``Receiver.prepare``."""
        return RGCWorkerExtension.rgc_receiver(self).prepare(load_tensors(source))

    @_refusals
    def rgc_commit(self, step) -> dict:
        """Write the prepared payload of ``step``; see ``Receiver.commit``."""
        return RGCWorkerExtension.rgc_receiver(self).commit(int(step))

    def rgc_discard(self) -> None:
        """Drop a prepared payload."""
        RGCWorkerExtension.rgc_receiver(self).discard()

    @_refusals
    def rgc_load(self, source, step=None) -> dict:
        """Load full trainer tensors (a resync) and return the fingerprint shares of them."""
        weights = load_tensors(source)
        receiver = RGCWorkerExtension.rgc_receiver(self)
        receiver.load(weights, None if step is None else int(step))
        return {"shares": receiver.fingerprints(list(weights))}

    @_refusals
    def rgc_fingerprints(self, names) -> dict:
        """``{"shares": {name: [[block key, share], ...]}}`` of the current weights."""
        return {"shares": RGCWorkerExtension.rgc_receiver(self).fingerprints(list(names))}

    @_refusals
    def rgc_read(self, names, dest=None):
        """This rank's blocks of ``names``: ``{name: [(key, tensor), ...]}``, or written to the
        safetensors file ``dest + ".rank<R>"`` (block ``i`` of ``name`` as ``name#i``) whose
        path is returned with the keys."""
        pieces = RGCWorkerExtension.rgc_receiver(self).read(list(names))
        if dest is None:
            return pieces
        from safetensors.torch import save_file

        path = f"{dest}.rank{int(getattr(self, 'rank', 0))}"
        save_file({f"{n}#{i}": t.contiguous() for n, blocks in pieces.items()
                   for i, (_, t) in enumerate(blocks)}, path)
        return {"path": path, "keys": {n: [key for key, _ in blocks]
                                       for n, blocks in pieces.items()}}
