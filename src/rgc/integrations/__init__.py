"""Entry points for the trainers people use; nothing in the rgc core imports this package.

* :func:`grad_norm`, :func:`clip_grad_norm_`: the gradient norm the update uses (from the
  sketches) and clipping, for any loop (plain PyTorch, accelerate).
* :func:`with_rgc` / :class:`RGCTrainerMixin`: transformers ``Trainer`` and TRL trainers.

See docs/integrations.md.
"""

from rgc.integrations.norms import clip_grad_norm_, grad_norm, unwrap_optimizer
from rgc.integrations.trainer import RGCTrainerMixin, probe_inputs, with_rgc

__all__ = ["RGCTrainerMixin", "clip_grad_norm_", "grad_norm", "probe_inputs",
           "unwrap_optimizer", "with_rgc"]
