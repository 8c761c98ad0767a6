"""transformers ``Trainer`` and the TRL trainers built on it (GRPO, RLOO, SFT, DPO, ...).

:func:`with_rgc` turns any Trainer subclass into one that trains an :func:`rgc.wrap`-ped model
with an rgc optimizer::

    from trl import GRPOConfig, GRPOTrainer
    import rgc
    from rgc.integrations import with_rgc

    rgc.wrap(model, rank=64)
    trainer = with_rgc(GRPOTrainer)(
        model=model, args=GRPOConfig(...), reward_funcs=..., train_dataset=...,
        rgc_optimizer=lambda params: rgc.RowAdam(params, lr=1e-5,
                                                 step_control=rgc.PredictedKL()))

What the subclass changes, and nothing else:

* ``create_optimizer``: the trainer builds the optimizer itself, from the trainable parameters
  of the (possibly accelerate/FSDP-wrapped) model, by calling ``rgc_optimizer(params)``; the
  default is ``rgc.RGCOptimizer`` with ``lr = rgc.calibrate_lr(model, args.learning_rate)``
  (the relative step whose first update matches AdamW at that learning rate). This is the path
  to use under FSDP, where ``optimizers=`` is refused; an optimizer passed as ``optimizers=``
  is used as it is. The LR scheduler scales ``lr`` as usual. ``args.weight_decay`` is not
  forwarded: set it in the factory (``rgc.RowAdam(..., weight_decay=...)``).
* ``grad_norm`` (logged) and ``max_grad_norm`` (clipping) come from the sketches via
  :func:`rgc.integrations.clip_grad_norm_`: the norm is ``||H||`` of the estimates the update
  uses; clipping is honoured for RowAdam and declined with a one-time warning for the
  normalised RGCOptimizer (see :mod:`rgc.integrations.norms`).
* With a step controller that has ``set_probe`` (e.g. :class:`rgc.PredictedKL`), every
  ``compute_loss`` sets the probe to the batch being trained on (:func:`probe_inputs`), unless
  ``rgc_auto_probe=False``.
* A TRL trainer with ``use_vllm=True`` (colocate mode) syncs its engine with rgc payloads
  instead of the weights (:mod:`rgc.integrations.vllm.trl`), unless ``rgc_vllm_sync=False``.

Checkpoints hold the plain weights under the plain names (a wrapped model's ``state_dict`` is
the original one), so ``AutoModelForCausalLM.from_pretrained(checkpoint)`` loads them without
rgc; the optimizer state and ``resume_from_checkpoint`` work as with any torch optimizer.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

import rgc
from rgc.integrations.norms import clip_grad_norm_

_CLASSES: dict[type, type] = {}


def probe_inputs(inputs: dict) -> tuple[dict, torch.Tensor | None]:
    """``(model kwargs, token mask)`` of a Trainer batch for :meth:`rgc.PredictedKL.set_probe`.

    TRL's online trainers (prompt and completion tensors): the whole sequence, KL over the
    completion tokens. Otherwise ``input_ids`` (and ``attention_mask``), KL over the tokens with
    a label (``labels != -100``), else over the attended ones.
    """
    if "completion_ids" in inputs:
        prompt_mask, completion_mask = inputs["prompt_mask"], inputs["completion_mask"]
        ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)
        tokens = torch.cat([torch.zeros_like(prompt_mask), completion_mask], dim=1).bool()
        return {"input_ids": ids, "attention_mask": mask}, tokens
    kwargs = {"input_ids": inputs["input_ids"]}
    tokens = None
    if inputs.get("attention_mask") is not None:
        kwargs["attention_mask"] = inputs["attention_mask"]
        tokens = inputs["attention_mask"].bool()
    if inputs.get("labels") is not None:
        tokens = inputs["labels"].ne(-100)
    return kwargs, tokens


class RGCTrainerMixin:
    """Mixin for a ``transformers.Trainer`` subclass; see the module docs (or :func:`with_rgc`).

    Extra keyword arguments:
        rgc_optimizer: ``params -> optimizer`` used by ``create_optimizer`` (e.g.
            ``functools.partial(rgc.RowAdam, lr=1e-5)``); ``None`` for the default above.
        rgc_auto_probe: set a step controller's probe from each training batch.
        rgc_vllm_sync: with TRL's ``use_vllm=True``, send each step's payload to the engine
            instead of the weights (``self.rgc_vllm`` is then the
            :class:`rgc.integrations.vllm.trl.PayloadSync`).
    """

    def __init__(self, *args, rgc_optimizer: Callable | None = None,
                 rgc_auto_probe: bool = True, rgc_vllm_sync: bool = True, **kwargs):
        self.rgc_optimizer = rgc_optimizer
        self.rgc_auto_probe = rgc_auto_probe
        use_vllm = rgc_vllm_sync and getattr(kwargs.get("args"), "use_vllm", False)
        if use_vllm:
            import rgc.integrations.vllm  # noqa: F401  (before TRL builds its engine: CPU set-up)
        super().__init__(*args, **kwargs)
        self.rgc_vllm = None
        if use_vllm and getattr(self, "vllm_generation", None) is not None:
            from rgc.integrations.vllm.trl import PayloadSync

            self.rgc_vllm = PayloadSync(self, self.vllm_generation)

    def create_optimizer(self, model=None):
        if self.optimizer is None:
            opt_model = self.model if model is None else model
            params = [p for p in opt_model.parameters() if p.requires_grad]
            if self.rgc_optimizer is not None:
                self.optimizer = self.rgc_optimizer(params)
            else:
                lr = rgc.calibrate_lr(opt_model, adamw_lr=self.args.learning_rate)
                self.optimizer = rgc.RGCOptimizer(params, lr=lr)
        if getattr(self, "rgc_vllm", None) is not None:
            self.rgc_vllm.watch(self.optimizer)
        return self.optimizer

    def _clip_grad_norm(self, model):
        return clip_grad_norm_(self.optimizer, self.args.max_grad_norm)

    def _get_grad_norm(self, model, grad_norm=None):
        # a tensor, as transformers' own: a distributed rgc optimizer fills it in step()
        return clip_grad_norm_(self.optimizer, math.inf) if grad_norm is None else grad_norm

    def compute_loss(self, model, inputs, *args, **kwargs):
        control = getattr(getattr(self.optimizer, "optimizer", self.optimizer), "step_control",
                          None)
        if self.rgc_auto_probe and model.training and hasattr(control, "set_probe"):
            probe, tokens = probe_inputs(inputs)
            control.set_probe(self.accelerator.unwrap_model(model), probe, token_mask=tokens)
        return super().compute_loss(model, inputs, *args, **kwargs)


def with_rgc(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass, e.g. TRL's ``GRPOTrainer``)
    with :class:`RGCTrainerMixin` mixed in; the same class is returned on every call."""
    if trainer_cls not in _CLASSES:
        _CLASSES[trainer_cls] = type(f"RGC{trainer_cls.__name__}", (RGCTrainerMixin, trainer_cls),
                                     {"__module__": __name__, "__doc__": RGCTrainerMixin.__doc__})
    return _CLASSES[trainer_cls]
