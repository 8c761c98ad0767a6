"""verl (>= 0.9.1, < 0.10): its FSDP2 training engine with rgc's sketched weights and optimizers.

Importing this package registers :class:`RGCFSDPEngine` with verl's engine registry; pass it
as verl's ``external_lib`` (``actor_rollout_ref.model.external_lib=rgc.integrations.verl``) and
set ``VERL_ENGINE_VENDOR=rgc`` in the workers' environment. See docs/verl.md for the overrides.
:mod:`rgc.integrations.verl.cpu` is a CPU platform for verl (tests, small experiments), chosen
with ``VERL_PLATFORM=cpu``; it is registered here, before verl's engines ask for their platform.
:mod:`~rgc.integrations.verl.sync` is the sketch-sized rollout sync (``sync: payload``), with
verl's vLLM adapter in :mod:`~rgc.integrations.verl.rollout` and the vLLM worker extension in
:mod:`~rgc.integrations.verl.worker` (both need vLLM).
"""

import os
import warnings

import verl

from rgc.integrations.verl import cpu  # noqa: F401  (registers the platform first)
from rgc.integrations.verl.engine import (
    OPTIMIZERS,
    OVERRIDE_KEYS,
    VENDOR,
    RGCFSDPEngine,
    check_config,
)

#: verl versions this integration is tested with (it overrides engine methods by name).
TESTED_VERL = ("0.9.",)

if not str(verl.__version__).startswith(TESTED_VERL):
    warnings.warn(f"rgc.integrations.verl is tested with verl {TESTED_VERL[0]}x, not "
                  f"{verl.__version__}: verl's engine interface changes between versions",
                  UserWarning, stacklevel=2)

if os.environ.get("VERL_ENGINE_VENDOR") != VENDOR:
    warnings.warn(f"rgc.integrations.verl is imported but VERL_ENGINE_VENDOR is "
                  f"{os.environ.get('VERL_ENGINE_VENDOR')!r}, not {VENDOR!r}: verl will build its "
                  "own FSDP engine, without rgc, in this process (see docs/verl.md)",
                  UserWarning, stacklevel=2)

__all__ = ["OPTIMIZERS", "OVERRIDE_KEYS", "TESTED_VERL", "VENDOR", "RGCFSDPEngine",
           "check_config"]
