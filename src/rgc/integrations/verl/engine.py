"""verl's FSDP2 training engine with rgc: sketched weights and rgc's distributed optimizers.

:class:`RGCFSDPEngine` is verl's ``FSDPEngineWithLMHead`` (``verl.workers.engine.fsdp``) with
five changes, and nothing else:

* before FSDP2 wraps the model, :func:`rgc.wrap` sketches its target linear layers (the
  state-dict keys stay the original ones, so verl's checkpoints, weight export and rollout
  sync see a plain model);
* the optimizer is :class:`rgc.DistributedRowAdam` or :class:`rgc.DistributedRGCOptimizer`,
  built from verl's optimizer config (``optim.optimizer``, ``lr``, ``betas``,
  ``weight_decay``) and ``optim.override_optimizer_config`` (:data:`OVERRIDE_KEYS`);
* the optimizer step: the gradient norm is rgc's global norm of the reduced sketch estimates
  (what the update uses; FSDP's ``clip_grad_norm_`` would see no gradient), logged by verl as
  ``grad_norm``; ``optim.clip_grad`` clips by it inside the step (RowAdam; RGCOptimizer's
  update is normalised, so clipping changes nothing there); a matrix whose sketch is not
  finite is skipped, its weight left bit-identical, and counted (metric
  ``rgc/skipped_updates``);
* configurations it cannot serve are refused in the constructor, before any weight is loaded
  or changed (:func:`check_config`);
* with ``override_optimizer_config.sync: payload``, ``get_per_tensor_param()`` returns a
  :class:`~rgc.integrations.verl.sync.RolloutSync`: verl's full-weight export, carrying the
  rgc payloads of the steps since the rollout's last sync for an adapter that sends those
  instead (:mod:`rgc.integrations.verl.sync`).

A forward-only engine (verl's reference policy) is verl's engine unchanged.

The engine is registered for ``strategy=fsdp2`` under the vendor key ``rgc``
(:data:`VENDOR`): verl picks it where ``VERL_ENGINE_VENDOR=rgc`` is set in the workers'
environment and this module has been imported (``model.external_lib=rgc.integrations.verl``).
See docs/verl.md.
"""

from __future__ import annotations

import math
import os
import warnings

import torch
from verl.utils.torch_dtypes import PrecisionType
from verl.workers.engine.base import EngineRegistry
from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

import rgc
from rgc.distributed import DistributedRGCOptimizer, DistributedRowAdam
from rgc.integrations.verl.sync import RolloutSync
from rgc.optim.rgc import check_direction_options
from rgc.sketched import check_refresh

#: ``VERL_ENGINE_VENDOR`` value that selects :class:`RGCFSDPEngine`.
VENDOR = "rgc"

#: ``optim.optimizer`` values and the rgc optimizers they build.
OPTIMIZERS = {"RowAdam": DistributedRowAdam, "RGCOptimizer": DistributedRGCOptimizer}

#: Keys of ``optim.override_optimizer_config`` read here; any other key is refused.
OVERRIDE_KEYS = {
    "rank": "sketch rank r of every compressed layer (required, an int >= 1)",
    "preset": "'rgc' (orthonormal P refreshed every step, default) or 'logra' (fixed "
              "Rademacher P)",
    "seed": "projection and rounding seed, the same on every rank (default 0)",
    "targets": "names of the linear layers to sketch (default: rgc.DEFAULT_TARGETS)",
    "eps": "RowAdam's eps (default 1e-8)",
    "refresh": "the projections' schedule: 'every_step', 'never' or every N updates "
               "(default: the preset's)",
    "momentum": "RGCOptimizer's momentum in sketch space (default 0; pair it with a refresh "
                "every N updates)",
    "nesterov": "RGCOptimizer's Nesterov variant of that momentum (default False)",
    "row_norm": "RGCOptimizer: every row of the direction gets the same norm (default False)",
    "step_control": "None, or the keyword arguments of rgc.PredictedKL (e.g. {budget: 2e-4})",
    "sync": "'full' (verl's weight sync, default) or 'payload' (get_per_tensor_param() "
            "carries the steps' rgc payloads: rgc.integrations.verl.sync)",
}

#: ``override_optimizer_config.sync`` values.
SYNC_MODES = ("full", "payload")


def _options(optimizer_config) -> dict:
    raw = getattr(optimizer_config, "override_optimizer_config", None) or {}
    try:  # an OmegaConf DictConfig
        from omegaconf import DictConfig, OmegaConf

        if isinstance(raw, DictConfig):
            raw = OmegaConf.to_container(raw, resolve=True)
    except ImportError:
        pass
    return dict(raw)


def check_config(model_config, engine_config, optimizer_config, world_size: int) -> dict:
    """The rgc options of a training engine's configs; ``ValueError`` naming the setting for
    anything :class:`RGCFSDPEngine` cannot serve. Reads configs only."""
    problems = []
    if engine_config.strategy != "fsdp2":
        problems.append(f"strategy={engine_config.strategy!r}: rgc trains under FSDP2 only "
                        "(set strategy=fsdp2)")
    if PrecisionType.to_dtype(engine_config.model_dtype) != torch.bfloat16:
        problems.append(f"model_dtype={engine_config.model_dtype!r}: rgc keeps BF16 weights "
                        "and writes them with stochastic rounding, no FP32 master copy (set "
                        "model_dtype=bfloat16)")
    mp = engine_config.mixed_precision or {}
    if PrecisionType.to_dtype(mp.get("param_dtype", "bf16")) != torch.bfloat16:
        problems.append(f"mixed_precision.param_dtype={mp.get('param_dtype')!r}: must be bf16")
    if getattr(model_config, "lora_rank", 0) > 0:
        problems.append("lora_rank > 0: rgc trains the full weights; set lora_rank=0")
    for name in ("param_offload", "optimizer_offload", "offload_policy"):
        if getattr(engine_config, name, False):
            problems.append(f"{name}=True: offloading is not supported with rgc")
    fsdp_size = getattr(engine_config, "fsdp_size", -1)
    if fsdp_size not in (-1, world_size):
        problems.append(f"fsdp_size={fsdp_size} (world size {world_size}): HSDP (replicated "
                        "shard groups) is not supported with rgc; set fsdp_size=-1")
    if getattr(engine_config, "ulysses_sequence_parallel_size", 1) > 1:
        problems.append("ulysses_sequence_parallel_size > 1 is not supported with rgc")
    qat = getattr(engine_config, "qat", None)
    if qat is not None and getattr(qat, "enable", False):
        problems.append("qat.enable=True is not supported with rgc")
    if optimizer_config.optimizer not in OPTIMIZERS:
        problems.append(f"optim.optimizer={optimizer_config.optimizer!r}: choose one of "
                        f"{sorted(OPTIMIZERS)}")
    options = _options(optimizer_config)
    unknown = sorted(set(options) - set(OVERRIDE_KEYS))
    if unknown:
        problems.append(f"optim.override_optimizer_config has keys rgc does not read: {unknown}"
                        f" (known: {sorted(OVERRIDE_KEYS)})")
    rank = options.get("rank")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        problems.append(f"optim.override_optimizer_config.rank={rank!r}: the sketch rank, an "
                        "int >= 1, is required")
    if options.get("preset", "rgc") not in rgc.nn.PRESETS:
        problems.append(f"optim.override_optimizer_config.preset={options.get('preset')!r}: "
                        f"one of {sorted(rgc.nn.PRESETS)}")
    if "refresh" in options:
        try:
            check_refresh(options["refresh"])
        except ValueError as e:
            problems.append(f"optim.override_optimizer_config.refresh: {e}")
    if {"momentum", "nesterov", "row_norm"} & set(options):
        if optimizer_config.optimizer != "RGCOptimizer":
            problems.append("optim.override_optimizer_config.momentum/nesterov/row_norm: "
                            f"RGCOptimizer's options, not {optimizer_config.optimizer}'s")
        try:
            check_direction_options(options.get("momentum", 0.0),
                                    options.get("nesterov", False),
                                    options.get("row_norm", False))
        except ValueError as e:
            problems.append(f"optim.override_optimizer_config: {e}")
    if options.get("sync", "full") not in SYNC_MODES:
        problems.append(f"optim.override_optimizer_config.sync={options.get('sync')!r}: one "
                        f"of {list(SYNC_MODES)}")
    if problems:
        raise ValueError("rgc's verl engine cannot serve this configuration:\n  - "
                         + "\n  - ".join(problems))
    return options


def _probe_mask(micro_batch, model_inputs: dict) -> torch.Tensor | None:
    """The tokens a micro-batch's loss is taken on, over the model's input layout (the loss
    mask shifted left by one, as verl's losses take it); ``None`` (every token) where the
    layout is not one of verl's two plain ones."""
    mask = micro_batch.get("loss_mask", None)
    ids = model_inputs["input_ids"]
    if mask is None or not getattr(mask, "is_nested", False):
        return None
    if model_inputs.get("attention_mask") is None:  # packed: (1, total tokens)
        flat = torch.roll(mask.values(), shifts=-1, dims=0).bool().unsqueeze(0)
        return flat if flat.shape == ids.shape else None
    padded = torch.nested.to_padded_tensor(mask, 0, output_size=tuple(ids.shape)).bool()
    return torch.nn.functional.pad(padded[:, 1:], (0, 1))


@EngineRegistry.register(model_type="language_model", backend="fsdp2",
                         device=["cuda", "npu", "cpu"], vendor=VENDOR)
class RGCFSDPEngine(FSDPEngineWithLMHead):
    """verl's FSDP2 engine training an :func:`rgc.wrap`-ped model (see the module docs)."""

    def __init__(self, model_config, engine_config, optimizer_config, checkpoint_config):
        self.rgc_options = None
        if not engine_config.forward_only:
            self.rgc_options = check_config(model_config, engine_config, optimizer_config,
                                            torch.distributed.get_world_size())
        super().__init__(model_config, engine_config, optimizer_config, checkpoint_config)
        self.rgc_control = None
        self.rgc_skipped = 0
        self._probe = None
        # payload sync: the optimizer step the rollout holds (None: unknown) and the payloads
        # of the steps since
        self.rgc_rollout_step: int | None = None
        self.rgc_payloads: list[dict[str, torch.Tensor]] = []

    @property
    def syncs_payloads(self) -> bool:
        return self.uses_rgc and self.rgc_options.get("sync", "full") == "payload"

    @property
    def uses_rgc(self) -> bool:
        return self.rgc_options is not None

    def _build_fsdp_module(self, module):
        if self.uses_rgc:
            opts = self.rgc_options
            rgc.wrap(module, opts["rank"], targets=opts.get("targets"),
                     preset=opts.get("preset", "rgc"), seed=opts.get("seed", 0),
                     refresh=opts.get("refresh"))
            if not rgc.sketched_weights(module):
                raise ValueError("rgc.wrap compressed no layer of this model")
        return super()._build_fsdp_module(module)

    def _build_optimizer(self, module):
        if not self.uses_rgc:
            return super()._build_optimizer(module)
        cfg, opts = self.optimizer_config, self.rgc_options
        params = [p for p in module.parameters() if p.requires_grad]
        kwargs = dict(lr=cfg.lr, weight_decay=cfg.weight_decay, seed=opts.get("seed", 0),
                      keep_updates=opts.get("sync", "full") == "payload")
        if cfg.optimizer == "RowAdam":
            kwargs.update(betas=tuple(cfg.betas), eps=opts.get("eps", 1e-8))
        else:
            kwargs.update(momentum=opts.get("momentum", 0.0),
                          nesterov=opts.get("nesterov", False),
                          row_norm=opts.get("row_norm", False))
        if opts.get("step_control") is not None:
            self.rgc_control = rgc.PredictedKL(**opts["step_control"])
            kwargs["step_control"] = self.rgc_control
        return OPTIMIZERS[cfg.optimizer](params, **kwargs)

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = super().prepare_model_inputs(micro_batch)
        if self.rgc_control is not None and torch.is_grad_enabled():
            # the probe of PredictedKL: the last micro-batch trained on, KL over its loss tokens
            self._probe = (dict(model_inputs, use_cache=False),
                           _probe_mask(micro_batch, model_inputs))
        return model_inputs, output_args

    def optimizer_step(self):
        if not self.uses_rgc:
            return super().optimizer_step()
        clip = self.optimizer_config.clip_grad
        max_norm = float(clip) if clip is not None and clip > 0 else math.inf
        norm = self.optimizer.clip_at_step(max_norm)
        if self.rgc_control is not None and self._probe is not None:
            inputs, mask = self._probe
            self.rgc_control.set_probe(self.module, inputs, token_mask=mask)
        self.optimizer.step()
        self._probe = None
        if self.syncs_payloads and self.rgc_rollout_step is not None:
            self.rgc_payloads.append(self.optimizer.export_update(self.module))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # reported below, every time
            skipped = self.optimizer.skipped_updates()
        grad_norm = norm.item()
        if skipped > self.rgc_skipped or not math.isfinite(grad_norm):
            print(f"WARN: grad_norm is not finite: {grad_norm}; rgc skipped "
                  f"{skipped - self.rgc_skipped} matrix update(s) with a non-finite sketch "
                  "(weights unchanged)")
        self.rgc_skipped = skipped
        return grad_norm

    def _control_path(self, local_path: str) -> str:
        return os.path.join(local_path, f"rgc_step_control_rank_{self.rank}.pt")

    def save_checkpoint(self, local_path, hdfs_path=None, global_step=0, max_ckpt_to_keep=None,
                        **kwargs):
        super().save_checkpoint(local_path, hdfs_path=hdfs_path, global_step=global_step,
                                max_ckpt_to_keep=max_ckpt_to_keep, **kwargs)
        if self.rgc_control is not None and local_path is not None:
            # the controller's step count (its annealed budget) is not optimizer state
            torch.save(self.rgc_control.state_dict(), self._control_path(local_path))

    def load_checkpoint(self, local_path, hdfs_path=None, del_local_after_load=True, **kwargs):
        control = None
        if self.rgc_control is not None and local_path is not None:
            path = self._control_path(local_path)
            if os.path.exists(path):
                control = torch.load(path, weights_only=True)
        super().load_checkpoint(local_path, hdfs_path=hdfs_path,
                                del_local_after_load=del_local_after_load, **kwargs)
        if control is not None:
            self.rgc_control.load_state_dict(control)
        self.rgc_rollout_step, self.rgc_payloads = None, []  # a full sync comes next

    def get_per_tensor_param(self, **kwargs):
        if not self.syncs_payloads:
            return super().get_per_tensor_param(**kwargs)

        def full():
            weights, _ = super(RGCFSDPEngine, self).get_per_tensor_param(**kwargs)
            return weights

        def synced(step=self.optimizer.steps_taken):
            self.rgc_rollout_step, self.rgc_payloads = step, []

        payloads = self.rgc_payloads if self.rgc_rollout_step is not None else []
        return RolloutSync(full, list(payloads), self.optimizer.steps_taken, synced), None

    def train_batch(self, data, loss_function):
        outputs = super().train_batch(data, loss_function)
        if self.uses_rgc and self.is_mp_src_rank_with_outputs():
            outputs["metrics"]["rgc/skipped_updates"] = self.rgc_skipped
            if self.rgc_control is not None and self.rgc_control.last is not None:
                for key in ("alpha", "predicted_kl", "realised_kl"):
                    if key in self.rgc_control.last:
                        outputs["metrics"][f"rgc/{key}"] = self.rgc_control.last[key]
        return outputs
