"""TRL's vLLM weight sync, with rgc payloads instead of the weights.

:class:`rgc.integrations.RGCTrainerMixin` (``with_rgc(GRPOTrainer)``) attaches a
:class:`PayloadSync` to a trainer built with ``use_vllm=True``. It replaces the trainer's
``vllm_generation.sync_weights``: the first sync loads the full weights
(:func:`~rgc.integrations.vllm.push_weights`), later ones push the payload of every optimizer
step taken since (collected by a step hook; the optimizer's ``keep_updates`` is switched on).
A refused payload is reported with a warning and followed by a full sync, so training goes
on with an engine that holds the trainer's weights.

Where rgc cannot replay updates, TRL's own sync runs unchanged: server mode (TRL's
``trl vllm-serve`` has its own worker extension and NCCL transport), colocate mode with
``vllm_tensor_parallel_size > 1`` (each trainer process holds one engine shard, and the shards'
fingerprints are not gathered) and ``vllm_enable_sleep_mode`` (level-2 sleep discards the
weights, so every sync is a full one).
"""

from __future__ import annotations

import warnings


class PayloadSync:
    """The weight sync of one TRL trainer (see the module docs).

    ``stats``: counts and bytes of payload and full syncs.
    """

    def __init__(self, trainer, generation):
        self.trainer = trainer
        self.generation = generation
        self.trl_sync = generation.sync_weights
        self.pending: list[dict] = []
        self.in_sync = False
        self.hooked = None
        self.stats = {"payloads": 0, "payload_bytes": 0, "full_syncs": 0, "full_bytes": 0}
        generation.sync_weights = self.sync

    @property
    def active(self) -> bool:
        """Whether payloads are sent (colocate mode, one engine rank, no sleep mode)."""
        g = self.generation
        return (g.mode == "colocate" and g.tensor_parallel_size == 1
                and not g.enable_sleep_mode)

    def model(self):
        return self.trainer.accelerator.unwrap_model(self.trainer.model)

    def watch(self, optimizer) -> None:
        """Collect ``optimizer``'s payload after each of its steps (once per optimizer)."""
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        if not self.active or self.hooked is inner or not hasattr(inner, "export_update"):
            return
        inner.keep_updates = True
        inner.register_step_post_hook(
            lambda opt, args, kwargs: self.pending.append(opt.export_update(self.model())))
        self.hooked = inner

    def sync(self) -> None:
        """Bring the engine to the trainer's weights: the pending payloads, or a full load."""
        if not self.active or self.hooked is None:
            self.pending.clear()
            return self.trl_sync()
        from rgc.integrations.vllm.client import push_update, push_weights

        llm = self.generation.llm
        if self.in_sync:
            try:
                for payload in self.pending:
                    self.stats["payload_bytes"] += push_update(llm, payload)
                    self.stats["payloads"] += 1
            except (ValueError, RuntimeError) as e:
                warnings.warn(f"rgc: the vLLM engine refused a payload ({e}); sending the full "
                              "weights instead", stacklevel=2)
                self.in_sync = False
        self.pending.clear()
        if not self.in_sync:
            self.stats["full_bytes"] += push_weights(llm, self.model(),
                                                     step=self.hooked.steps_taken)
            self.stats["full_syncs"] += 1
            self.in_sync = True
