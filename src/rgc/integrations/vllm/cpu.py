"""Workarounds for vLLM's CPU backend, switched on only when vLLM runs on a CPU.

:func:`install` is called when :mod:`rgc.integrations.vllm` is imported, which vLLM does in
each worker before it loads the model when the engine is started with
``worker_extension_cls="rgc.integrations.vllm.RGCWorkerExtension"``. For an engine in this
process without the extension (TRL's colocate mode), import :mod:`rgc.integrations.vllm`
before the engine is built. Each change is process-wide and only affects engines loaded
afterwards.

* **Plain linear weights.** After loading, the CPU backend repacks each linear layer's
  weight for its GEMM library (oneDNN, or AMX kernels) and replaces ``.weight`` with an empty
  tensor, so an update written to ``.weight`` would change nothing and the weight loader
  asserts. Here 2-D linear weights are left as they are and multiplied with
  ``torch.nn.functional.linear``, as on a GPU (slower GEMMs; generation stays correct).
* **No AMX attention for BF16.** On one CPU with AMX, BF16 generation died with SIGILL in
  the AMX attention path (FP32, and BF16 with AMX off, ran); attention uses the AVX-512
  vector path instead. (Not reproduced on the CPUs without AMX that the tests ran on.)
"""

from __future__ import annotations

import logging

_INSTALLED = False
logger = logging.getLogger(__name__)


def on_cpu() -> bool:
    """True when vLLM is installed and its platform is the CPU."""
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return False
    return current_platform.is_cpu()


def install() -> bool:
    """Switch the workarounds on in this process if vLLM runs on a CPU; True if they are."""
    global _INSTALLED
    if _INSTALLED or not on_cpu():
        return _INSTALLED
    import torch
    from vllm.model_executor.layers import utils
    from vllm.v1.attention.backends import cpu_attn

    repack = utils.dispatch_cpu_unquantized_gemm

    def plain_gemm(layer, remove_weight):
        if layer.weight.is_meta or layer.weight.ndim != 2:
            return repack(layer, remove_weight)
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    choose_isa = cpu_attn._get_attn_isa

    def isa_without_amx(dtype, block_size, *args, **kwargs):
        isa = choose_isa(dtype, block_size, *args, **kwargs)
        return "vec" if isa == "amx" else isa

    utils.dispatch_cpu_unquantized_gemm = plain_gemm
    cpu_attn._get_attn_isa = isa_without_amx
    _INSTALLED = True
    logger.info("rgc: vLLM CPU backend keeps linear weights plain; no AMX attention")
    return True
