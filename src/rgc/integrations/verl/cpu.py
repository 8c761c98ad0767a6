"""A CPU platform for verl (``VERL_PLATFORM=cpu``): its training engine on CPU processes joined
by gloo, for tests and small experiments.

verl >= 0.9 resolves its device (``cuda``, ``npu``, ...) through a platform registry
(:mod:`verl.plugin.platform`) and ships none for the CPU. Importing this module registers one
under the name ``cpu``; it is never auto-detected (``is_platform_available`` is false), so it
is used only where ``VERL_PLATFORM=cpu`` is set before verl first asks for its platform, or
after :func:`use_cpu_platform`. What it gives verl:

* device ``cpu``, ``current_device()`` ``"cpu"`` (verl moves tensors with ``.to(device_id)``),
  communication backend ``gloo``;
* a device module whose memory statistics are zeros (verl logs them) and whose caches and
  synchronisation are no-ops;
* where ``VERL_PLATFORM=cpu`` is set, verl's ``initialize_global_process_group`` (what its SFT
  trainer calls under ``torchrun``) is replaced by one that asks for ``gloo``: verl's asks for
  ``cpu:gloo,<device>:<backend>``, which names the CPU twice here and is refused by torch.

What still needs a GPU: rollouts (vLLM / SGLang servers), Ray's GPU scheduling, fused kernels
and flash attention (set ``attn_implementation`` to ``eager`` or ``sdpa``).
"""

from __future__ import annotations

import contextlib
import os
from datetime import timedelta
from types import SimpleNamespace

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry, set_platform


def _zero(*args, **kwargs) -> int:
    return 0


def _none(*args, **kwargs) -> None:
    return None


#: What verl calls on ``get_torch_device()`` (``torch.cuda`` on a GPU).
DEVICE_MODULE = SimpleNamespace(
    is_available=lambda: True,
    current_device=lambda: "cpu",
    device_count=lambda: 1,
    set_device=_none,
    synchronize=_none,
    empty_cache=_none,
    manual_seed=torch.manual_seed,
    manual_seed_all=torch.manual_seed,
    get_rng_state=torch.get_rng_state,
    set_rng_state=torch.set_rng_state,
    memory_allocated=_zero,
    memory_reserved=_zero,
    max_memory_allocated=_zero,
    max_memory_reserved=_zero,
    reset_peak_memory_stats=_none,
    mem_get_info=lambda *a, **k: (0, 0),
    set_per_process_memory_fraction=_none,
    is_initialized=lambda: True,
    get_device_name=lambda *args, **kwargs: "CPU",  # verl's flops counter: an unknown device
)


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    """verl's platform interface on the CPU (see the module docs)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self):
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check=False) -> bool:
        return False  # chosen explicitly only, never by verl's probe

    def current_device(self):
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index) -> None:
        pass

    def synchronize(self, device_index=None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0):
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def ray_resource_options(self, num_gpus: float) -> dict:
        return {"num_cpus": num_gpus}

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self):
        return None


def use_cpu_platform() -> None:
    """Make :class:`PlatformCPU` verl's platform in this process (before verl builds anything
    that asks for its device)."""
    set_platform(PlatformCPU())


def initialize_global_process_group(timeout_second: int = 36000) -> tuple[int, int, int]:
    """verl's ``verl.utils.distributed.initialize_global_process_group`` on gloo alone."""
    import torch.distributed as dist

    dist.init_process_group(backend="gloo", timeout=timedelta(seconds=timeout_second),
                            init_method=os.environ.get("DIST_INIT_METHOD", None))
    return int(os.environ["LOCAL_RANK"]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


if os.environ.get("VERL_PLATFORM", "").strip().lower() == "cpu":
    import verl.utils.distributed

    verl.utils.distributed.initialize_global_process_group = initialize_global_process_group
