"""verl's vLLM rollout adapter with rgc's payload sync (needs vLLM).

Importing this module (``actor_rollout_ref.model.external_lib=rgc.integrations.verl.rollout``,
which also imports :mod:`rgc.integrations.verl`) makes :class:`RGCServerAdapter` verl's
adapter for ``rollout.name=vllm`` in that process: verl's ``ServerAdapter`` whose
``update_weights`` sends rgc payloads where it can (:class:`~rgc.integrations.verl.sync.
PayloadSyncMixin`) and anything else exactly as verl does.
"""

from __future__ import annotations

from verl.workers.rollout import base
from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

import rgc.integrations.verl  # noqa: F401  (the engine and the CPU platform)
from rgc.integrations.verl.sync import PayloadSyncMixin


class RGCServerAdapter(PayloadSyncMixin, ServerAdapter):
    """verl's vLLM ``ServerAdapter`` with rgc's payload sync."""


base._ROLLOUT_REGISTRY[("vllm", "async")] = f"{__name__}.RGCServerAdapter"
