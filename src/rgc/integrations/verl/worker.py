"""The vLLM worker extension of a verl rollout with rgc's payload sync (needs vLLM).

Start verl's vLLM rollout with
``+actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=``
``rgc.integrations.verl.worker.RGCVerlWorkerExtension``: verl's own extension
(``vLLMColocateWorkerExtension``: full-weight loads, LoRA, quantised weights) with rgc's
receiver (:class:`rgc.integrations.vllm.RGCWorkerExtension`) and the calls
:class:`rgc.integrations.verl.sync.PayloadSyncMixin` makes.
"""

from __future__ import annotations

import torch
from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

from rgc.integrations.verl.sync import split_payloads
from rgc.integrations.vllm.extension import RGCWorkerExtension


class RGCVerlWorkerExtension(RGCWorkerExtension, vLLMColocateWorkerExtension):
    """verl's colocated worker extension plus rgc's payload receiver."""

    def rgc_receive_payloads(self, use_shm: bool = False) -> dict:
        """Receive payload tensors from this rank's trainer through verl's bucketed transport
        and keep them for :meth:`rgc_prepare` (``"received:<i>"``)."""
        received: list[tuple[str, torch.Tensor]] = []
        device = getattr(self, "device", None) or torch.device("cpu")
        BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=device,
                               use_shm=use_shm).receive_weights(
            # copied out of the transport's buffer, which the next bucket reuses
            lambda weights, is_last: received.extend((n, t.clone()) for n, t in weights))
        self._rgc_received = split_payloads(received)
        return {"payloads": len(self._rgc_received)}

    def rgc_prepare(self, source) -> dict:
        """``RGCWorkerExtension.rgc_prepare``; ``"received:<i>"`` names a received payload."""
        if isinstance(source, str) and source.startswith("received:"):
            source = self._rgc_received[int(source.partition(":")[2])]
        return RGCWorkerExtension.rgc_prepare(self, source)

    def rgc_drop_received(self) -> None:
        self._rgc_received = []

    def rgc_synced(self, step: int) -> None:
        """verl loaded the full weights of optimizer step ``step``: the next payload is
        ``step + 1``."""
        receiver = self.rgc_receiver()
        receiver.discard()
        receiver.step = int(step)
