"""Sketch-sized weight sync into a running vLLM engine.

Engine side: start vLLM with ``worker_extension_cls="rgc.integrations.vllm.RGCWorkerExtension"``
(``vllm serve ... --worker-extension-cls rgc.integrations.vllm.RGCWorkerExtension``). Trainer
side::

    from rgc.integrations.vllm import push_update, push_weights

    push_weights(llm, model)                       # once: the engine holds the trainer's weights
    for batch in ...:
        ...; opt.step()                            # RGCOptimizer / RowAdam(keep_updates=True)
        push_update(llm, opt.export_update(model)) # the update, not the weights

:func:`push_update` replays each update bit-exactly on the engine's own (fused, sharded)
weights: q/k/v as row slices of ``qkv_proj``, gate/up of ``gate_up_proj``, each tensor-parallel
rank its shard. See docs/vllm.md.

Modules: :mod:`.layout` (where a trainer tensor lives in the engine), :mod:`.receiver` (check
and apply a payload), :mod:`.extension` (the worker calls), :mod:`.client` (the trainer
calls), :mod:`.cpu` (CPU-backend workarounds, installed on import when vLLM runs on a CPU).
"""

from rgc.integrations.vllm import cpu
from rgc.integrations.vllm.client import push_update, push_weights, read_weights
from rgc.integrations.vllm.extension import RGCWorkerExtension
from rgc.payload import PayloadError

cpu.install()

__all__ = ["PayloadError", "RGCWorkerExtension", "push_update", "push_weights", "read_weights"]
