"""Sketch-sized rollout sync in verl: rgc payloads through verl's bucketed weight transport.

With ``override_optimizer_config.sync: payload`` the engine
(:class:`~rgc.integrations.verl.RGCFSDPEngine`) exports each optimizer step's update
(``optimizer.export_update``) once the rollout holds its weights, and its
``get_per_tensor_param()`` returns a :class:`RolloutSync`:

* iterated, it is verl's full-weight export, unchanged: whatever consumes it (verl's own
  rollout adapters and checkpoint engines) sends the full weights, as without rgc;
* :class:`PayloadSyncMixin` (in verl's vLLM rollout adapter,
  :class:`rgc.integrations.verl.rollout.RGCServerAdapter`) sends only ``sync.payloads`` (the
  steps since the rollout's last sync, in order) through verl's
  ``BucketedWeightSender`` (CUDA IPC, or shared memory) to the vLLM worker extension
  :class:`rgc.integrations.verl.worker.RGCVerlWorkerExtension`, which replays them bit-exactly
  with rgc's receiver (:func:`rgc.integrations.vllm.client.push_update`'s checks). A payload
  the engine refuses (its weights are not the payload's base: a restarted or slept engine)
  changes nothing there, and the adapter sends the full weights instead, with a warning.

Payload tensors travel as named tensors ``rgc.payload.<i>.<key>`` (``i``: the payload's place
in ``sync.payloads``), so any of verl's named-tensor transports carries them.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch

from rgc.integrations.vllm.client import Engine, push_update
from rgc.payload import payload_nbytes

#: Name prefix of a payload tensor on verl's named-tensor transports.
PREFIX = "rgc.payload."


def payload_tensors(payloads: list[dict[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every payload in order, named ``rgc.payload.<i>.<key>``."""
    for i, payload in enumerate(payloads):
        for key, tensor in payload.items():
            yield f"{PREFIX}{i}.{key}", tensor


def split_payloads(named: Iterable[tuple[str, torch.Tensor]]) -> list[dict[str, torch.Tensor]]:
    """The payloads of :func:`payload_tensors` from its ``(name, tensor)`` pairs, in order
    (the tensors as given: copy them out of a transport's reused buffer first). ``ValueError``
    for another name or a missing payload."""
    payloads: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        index, dot, key = name[len(PREFIX):].partition(".")
        if not name.startswith(PREFIX) or not dot or not index.isdigit():
            raise ValueError(f"{name!r} is not an rgc payload tensor ({PREFIX}<i>.<key>)")
        payloads.setdefault(int(index), {})[key] = tensor
    if sorted(payloads) != list(range(len(payloads))):
        raise ValueError(f"payloads {sorted(payloads)} arrived; expected 0..{len(payloads) - 1}")
    return [payloads[i] for i in range(len(payloads))]


class RolloutSync:
    """What the engine's ``get_per_tensor_param()`` returns with ``sync: payload``.

    Iterating it yields verl's full-weight export ``(name, tensor)`` (each rank the whole
    tensors); once iterated to the end, the engine counts the rollout as holding its weights.
    ``payloads``: the payloads of the optimizer steps since the rollout's last sync, in step
    order (empty: the rollout's weights are unknown, only a full sync will do). ``step``: the
    optimizer steps taken; the rollout holds this step's weights after the sync.
    :meth:`delivered` tells the engine the payloads arrived instead.
    """

    def __init__(self, full: Callable[[], Iterable[tuple[str, torch.Tensor]]],
                 payloads: list[dict[str, torch.Tensor]], step: int,
                 on_synced: Callable[[], None]):
        self._full, self.payloads, self.step, self._on_synced = full, payloads, step, on_synced

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._full()
        self._on_synced()

    def delivered(self) -> None:
        """The rollout applied every payload: it holds step :attr:`step`'s weights."""
        self._on_synced()

    def nbytes(self) -> int:
        """Bytes of the payload tensors."""
        return sum(t.numel() * t.element_size() for p in self.payloads for t in p.values())


async def _any_rank(flag: bool) -> bool:
    """True if ``flag`` is true on any rank of the default process group (one all-reduce)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return flag
    t = torch.tensor([int(flag)])
    await asyncio.to_thread(torch.distributed.all_reduce, t, torch.distributed.ReduceOp.MAX)
    return bool(t.item())


class PayloadSyncMixin:
    """``update_weights`` of a verl rollout adapter that sends a :class:`RolloutSync`'s
    payloads instead of the weights where it can (mixed in before verl's ``ServerAdapter``).

    It uses the adapter's ``zmq_handle``, ``use_shm``, ``config`` and ``_execute_method``
    (verl's vLLM ``ServerAdapter``), and calls on the engine's workers the methods of
    :class:`rgc.integrations.verl.worker.RGCVerlWorkerExtension`. Every trainer rank sends to
    its own rollout worker; the ranks that talk to a server check and apply, and all ranks
    agree (one all-reduce of a flag) whether the payloads were applied or the full weights
    must follow.
    """

    async def update_weights(self, weights, global_steps: int | None = None,
                             wire_format: str = "named_tensors", **kwargs):
        payload_path = (isinstance(weights, RolloutSync) and weights.payloads
                        and wire_format == "named_tensors" and not kwargs.get("peft_config"))
        if payload_path:
            refused = await self.rgc_send_payloads(weights)
            refused_anywhere = await _any_rank(refused is not None)
            if not refused_anywhere:
                weights.delivered()
                await self.rgc_after_update(global_steps)
                return None
            warnings.warn(f"the rollout refused rgc's payloads ({refused or 'on another rank'});"
                          " sending the full weights instead", RuntimeWarning, stacklevel=2)
        result = await super().update_weights(weights, global_steps=global_steps,
                                              wire_format=wire_format, **kwargs)
        if isinstance(weights, RolloutSync):
            await self._execute_method("rgc_synced", args=(weights.step,))
        return result

    async def rgc_send_payloads(self, sync: RolloutSync) -> str | None:
        """Send ``sync.payloads`` through verl's bucketed transport and apply them on the
        rollout; ``None``, or why they were refused (the rollout's weights unchanged)."""
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
            BucketedWeightSender,
        )

        future = await self._execute_method("rgc_receive_payloads", non_block=True,
                                            kwargs={"use_shm": self.use_shm})
        sender = BucketedWeightSender(
            zmq_handle=self.zmq_handle, use_shm=self.use_shm,
            bucket_size_mb=self.config.checkpoint_engine.update_weights_bucket_megabytes)
        await sender.async_send_weights(payload_tensors(sync.payloads))
        if future is None:  # a rank without a server only sends to its worker
            return None
        await future
        try:
            await asyncio.to_thread(self.rgc_apply_received, sync.payloads)
        except (ValueError, RuntimeError) as e:
            return str(e)
        finally:
            await self._execute_method("rgc_drop_received")
        return None

    def rgc_apply_received(self, payloads: list[dict[str, torch.Tensor]]) -> None:
        """Check and apply the received payloads in order (blocking; in a thread)."""
        handle = ReceivedPayloads(self.rgc_call, payloads)
        for payload in payloads:
            push_update(handle, payload)

    def rgc_call(self, method: str, *args) -> list:
        """``collective_rpc(method, args)`` on the engine's workers, blocking."""
        import ray

        return ray.get(self.server_handle.collective_rpc.remote(method, args=args))

    async def rgc_after_update(self, global_steps: int | None) -> None:
        """What verl's adapter does after a weight update: clear the KV cache, set the step."""
        if self._has_server:
            await self.server_handle.clear_kv_cache.remote()
            if global_steps is not None:
                await self.server_handle.set_global_steps.remote(global_steps)


class ReceivedPayloads(Engine):
    """The :class:`rgc.integrations.vllm.client.Engine` of payloads the workers already
    received through verl's transport: ``send`` names one by its place in the list."""

    def __init__(self, call: Callable[..., list], payloads: list[dict[str, torch.Tensor]]):
        self.url = self.llm = self.worker = None
        self._rpc, self._index = call, {id(p): i for i, p in enumerate(payloads)}

    def _call(self, method: str, *args) -> list:
        return self._rpc(method, *args)

    def send(self, tensors: dict[str, torch.Tensor]):
        return f"received:{self._index[id(tensors)]}", payload_nbytes(tensors), lambda: None

    def reset_prefix_cache(self) -> None:
        """verl clears the KV cache after the whole update (:meth:`rgc_after_update`)."""
