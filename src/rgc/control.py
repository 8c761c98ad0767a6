"""Predicted-KL step control: scale each update so the policy moves by a set KL budget.

For a proposed update ``dW`` (all parameters together) the logits on a probe batch move, to
first order, by ``dz_t = J_t dW`` (a forward-mode JVP), and the KL divergence of the
next-token distributions is, to second order (Fisher),

    KL(p_old || p_new)(alpha) ~ alpha^2 * kappa,   kappa = 1/2 mean_t Var_{v ~ p_t}(dz_t,v)

so ``alpha = min(max_scale, sqrt(budget / kappa))`` spends exactly the budget (or the cap).

The JVP never forms a dense ``dW`` for a compressed layer: its output tangent is
``-(coef (X P) U^T + decay X W^T)``, built from ``X P`` (n x r), the factor ``U`` (d x r) and
the layer's own output. A sketched expert stack gets the same per expert, on the rows routed
to it, from the sketched experts forward (:func:`rgc.experts.module.update_tangents`).
Parameters with dense updates get their tangent directly.

Attention: the JVP and the realised-KL forward run under
``sdpa_kernel(SDPBackend.MATH)``, because the fused CPU flash SDPA kernel has no forward-mode
derivative (torch 2.13). transformers models with ``attn_implementation='eager'`` or
``'sdpa'`` work; kernel-based implementations (``flash_attention_2``/``_3``, ``flex_attention``)
are rejected with a message: call ``model.set_attn_implementation('sdpa')`` first.
"""

from __future__ import annotations

import math
import sys
import warnings
from collections.abc import Callable

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn as nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from rgc.experts.module import ExpertWeight, update_tangents
from rgc.updates import DenseUpdate, LowRankUpdate, is_zero

SCHEDULES = ("linear", "cosine")
FORWARD_AD_ATTENTION = ("eager", "sdpa")


def default_logits(output) -> torch.Tensor:
    """``output.logits`` (transformers), else ``output[0]`` for a tuple, else ``output``."""
    if hasattr(output, "logits"):
        return output.logits
    if isinstance(output, (tuple, list)):
        return output[0]
    return output


def _forward(model: nn.Module, inputs, params: dict | None = None):
    args, kwargs = ((), inputs) if isinstance(inputs, dict) else ((inputs,), {})
    try:
        with sdpa_kernel([SDPBackend.MATH]):
            if params:
                return torch.func.functional_call(model, params, args, kwargs)
            return model(*args, **kwargs)
    finally:
        _reshard(model)


def _reshard(model: nn.Module) -> None:
    """Free the weights FSDP2 gathered for a probe forward. A module with
    ``reshard_after_forward=False`` keeps them after a forward that no backward follows, and
    its next forward would reuse them: after the probe they are stale, the optimizer having
    written the shards since."""
    # not imported here (torch.distributed's tensor package: ~0.8 s): a model sharded by FSDP2
    # was sharded after someone imported it
    fsdp_module = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    if fsdp_module is None:
        return
    for module in model.modules():
        if isinstance(module, fsdp_module):
            module.reshard()


def _check_attention(model: nn.Module) -> None:
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if impl is not None and impl not in FORWARD_AD_ATTENTION:
        raise ValueError(
            f"attention implementation {impl!r} has no forward-mode derivative; predicted-KL "
            f"step control supports {FORWARD_AD_ATTENTION}: call "
            "model.set_attn_implementation('sdpa') (or load with attn_implementation='eager')")


def _lowrank_tangent_hook(update: LowRankUpdate):
    projection, factor = update.layer.projection, update.factor

    def hook(module, args, output):
        x = fwAD.unpack_dual(args[0]).primal
        out = fwAD.unpack_dual(output).primal
        xp = x.to(torch.float32) @ projection.to(torch.float32)  # X P: (..., r); no d x k dW
        tangent = (xp @ factor.t()).mul_(-update.coef)
        if not is_zero(update.decay):
            xw = out if module.bias is None else out - fwAD.unpack_dual(module.bias).primal
            tangent.sub_(xw.to(torch.float32) * update.decay)
        return output + fwAD.make_dual(torch.zeros_like(out), tangent.to(out.dtype))

    return hook


def logits_jvp(model: nn.Module, inputs, updates, *,
               logits_fn: Callable = default_logits) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits on ``inputs`` and their directional derivative along ``updates``.

    Args:
        model: the trained model (wrapped with :func:`rgc.wrap`).
        inputs: a tensor (passed positionally) or a dict of keyword arguments.
        updates: :class:`LowRankUpdate` / :class:`DenseUpdate` proposals (alpha = 1).
        logits_fn: picks the logits (``(..., vocab)``) out of the model output.

    Returns ``(logits, tangent)``, both ``(..., vocab)`` in the model's dtype. Runs under
    ``no_grad`` (no sketch is accumulated) with the model in eval mode.
    """
    _check_attention(model)
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    handles, dense, experts = [], {}, []
    was_training = [(m, m.training) for m in model.modules()]
    try:
        model.eval()
        with torch.no_grad(), fwAD.dual_level():
            for u in updates:
                if isinstance(u, LowRankUpdate) and isinstance(u.layer, ExpertWeight):
                    experts.append(u)
                elif isinstance(u, LowRankUpdate):
                    handles.append(u.layer.register_forward_hook(_lowrank_tangent_hook(u)))
                else:
                    assert isinstance(u, DenseUpdate)
                    if id(u.param) not in names:
                        raise ValueError("a parameter the optimizer updates is not in the probe "
                                         "model; pass the trained model to set_probe()")
                    t = -u.coef * u.direction.to(torch.float32)
                    if not is_zero(u.decay):
                        t -= u.decay * u.param.to(torch.float32)
                    dense[names[id(u.param)]] = fwAD.make_dual(u.param, t.to(u.param.dtype))
            try:
                with update_tangents(experts):
                    out = logits_fn(_forward(model, inputs, dense))
            except NotImplementedError as e:
                raise RuntimeError(
                    f"forward-mode AD failed inside the model ({e}); predicted-KL step control "
                    f"needs attention in {FORWARD_AD_ATTENTION} and differentiable ops") from e
            primal, tangent = fwAD.unpack_dual(out)
            if tangent is None:
                tangent = torch.zeros_like(primal)
    finally:
        for h in handles:
            h.remove()
        for m, mode in was_training:
            m.training = mode
    return primal, tangent


def _token_select(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """``x`` (..., V) -> (n, V) over all tokens, or those where ``mask`` (...) is true."""
    if mask is None:
        return x.reshape(-1, x.shape[-1])
    return x[mask.to(device=x.device, dtype=torch.bool)]


def _variances(logits: torch.Tensor, tangent: torch.Tensor,
               token_mask: torch.Tensor | None) -> torch.Tensor:
    """``Var_{v ~ softmax(logits_t)}(tangent_t,v)`` per selected token, float64 ``(n,)``."""
    z = _token_select(logits, token_mask).to(torch.float64)
    dz = _token_select(tangent, token_mask).to(torch.float64)
    p = torch.softmax(z, dim=-1)
    mean = (p * dz).sum(-1, keepdim=True)
    return (p * (dz - mean).square()).sum(-1)


def _divergences(logits_old: torch.Tensor, logits_new: torch.Tensor,
                 token_mask: torch.Tensor | None) -> torch.Tensor:
    """``KL(softmax(old_t) || softmax(new_t))`` per selected token, float64 ``(n,)``."""
    lp = torch.log_softmax(_token_select(logits_old, token_mask).to(torch.float64), -1)
    lq = torch.log_softmax(_token_select(logits_new, token_mask).to(torch.float64), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


def mean_over_ranks(values: torch.Tensor, optimizer) -> float:
    """The mean of per-token ``values`` (float64 ``(n,)``) over the tokens of every rank that
    trains with ``optimizer`` (its ``sum_over_ranks``: one all-reduce of two float64 on several
    processes; on one process the plain mean). One host read; ``ValueError`` when no rank has a
    token."""
    sums = torch.stack([values.sum(), torch.tensor(float(values.numel()), dtype=torch.float64,
                                                   device=values.device)])
    reduce = getattr(optimizer, "sum_over_ranks", None)
    if reduce is not None:
        sums = reduce(sums)
    mean = float(sums[0] / sums[1])
    if math.isnan(mean) and float(sums[1]) == 0:  # a second read only in this case
        raise ValueError("the probe's token_mask selects no token")
    return mean


class PredictedKL:
    """Step control: scale every update so that the predicted KL equals an annealed budget.

    Per step, with ``kappa`` from a forward-mode JVP on the probe batch (see module docs)::

        alpha = min(max_scale, sqrt(budget_s / kappa))     (max_scale when kappa == 0)
        every proposed update is applied times alpha

    ``budget_s`` anneals from ``budget`` at the first controlled step to ``final_budget`` at
    step ``anneal_steps + 1`` and stays there (``linear`` or ``cosine`` in between;
    ``final_budget=None`` keeps it constant). A non-finite kappa skips the step (alpha = 0).

    Usage::

        ctl = rgc.PredictedKL(budget=2e-4, final_budget=2e-5, anneal_steps=200)
        opt = rgc.RowAdam(model.parameters(), lr=1e-4, step_control=ctl)
        ...; loss.backward()
        ctl.set_probe(model, {"input_ids": ids, "attention_mask": am}, token_mask=resp_mask)
        opt.step()
        ctl.last  # {'step', 'budget', 'kappa', 'alpha', 'predicted_kl', 'realised_kl'}

    The probe stays set until replaced. Costs per step: one forward with tangents (about two
    forwards) and, with ``measure_realised`` (default), one more forward after the update
    that reports ``KL(p_old || p_new)`` on the probe. The probe's logits (n x vocab) are kept
    in between. ``history`` holds every step's record.

    Args:
        budget: KL per step at the start (> 0).
        final_budget: KL per step after annealing (> 0), or ``None`` (default) for a
            constant budget.
        anneal_steps: steps from ``budget`` to ``final_budget`` (>= 1); required when
            ``final_budget`` differs from ``budget``.

    ``PredictedKL()`` is a constant budget of 2e-4 per step.
        schedule: 'linear' or 'cosine'.
        max_scale: cap on alpha (> 0). The default 1.0 only ever shrinks the optimizer's
            step; a larger cap lets quiet directions take a longer step.
        measure_realised: run the extra forward for the realised KL.
    """

    def __init__(self, budget: float = 2e-4, final_budget: float | None = None, *,
                 anneal_steps: int | None = None, schedule: str = "linear",
                 max_scale: float = 1.0,
                 measure_realised: bool = True):
        for name, value in (("budget", budget), ("max_scale", max_scale)) + (
                (("final_budget", final_budget),) if final_budget is not None else ()):
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
        if final_budget is None or final_budget == budget:
            anneal_steps = 1 if anneal_steps is None else anneal_steps
        elif anneal_steps is None:
            raise ValueError("anneal_steps is required when final_budget differs from budget "
                             "(or pass final_budget=None for a constant budget)")
        if not isinstance(anneal_steps, int) or isinstance(anneal_steps, bool) or anneal_steps < 1:
            raise ValueError(f"anneal_steps must be an integer >= 1, got {anneal_steps!r}")
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
        self.budget = float(budget)
        self.final_budget = float(budget if final_budget is None else final_budget)
        self.anneal_steps = anneal_steps
        self.schedule = schedule
        self.max_scale = float(max_scale)
        self.measure_realised = measure_realised
        self.steps = 0
        self.history: list[dict] = []
        self._probe = None
        self._pending = None

    def budget_at(self, step: int) -> float:
        """The budget of controlled step ``step`` (0-based)."""
        f = min(max(step, 0) / self.anneal_steps, 1.0)
        if self.schedule == "cosine":
            f = 0.5 * (1.0 - math.cos(math.pi * f))
        return (1.0 - f) * self.budget + f * self.final_budget

    def set_probe(self, model: nn.Module, inputs, *, token_mask: torch.Tensor | None = None,
                  logits_fn: Callable = default_logits) -> None:
        """Set the probe batch used from the next ``step()`` on.

        Args:
            model: the trained model (the one the optimizer's parameters belong to).
            inputs: a tensor, passed positionally, or a dict of keyword arguments.
            token_mask: optional bool tensor over the logits' leading dims (e.g. (batch,
                seq)): the tokens the KL is averaged over (e.g. the response tokens).
            logits_fn: picks ``(..., vocab)`` logits out of the model's output.
        """
        _check_attention(model)
        self._probe = (model, inputs, token_mask, logits_fn)

    def check_ready(self) -> None:
        """Raise unless a probe is set (called by the optimizer before it changes anything)."""
        if self._probe is None:
            raise RuntimeError("PredictedKL has no probe batch: call "
                               "controller.set_probe(model, inputs) before optimizer.step()")

    def scale(self, optimizer, updates) -> float:
        """alpha for this step's ``updates`` (called by the optimizer before applying)."""
        self.check_ready()
        model, inputs, mask, logits_fn = self._probe
        logits, tangent = logits_jvp(model, inputs, updates, logits_fn=logits_fn)
        kappa = 0.5 * mean_over_ranks(_variances(logits, tangent, mask), optimizer)
        budget = self.budget_at(self.steps)
        if not math.isfinite(kappa):
            warnings.warn("predicted-KL step control: non-finite kappa, the step is skipped "
                          "(alpha = 0)", RuntimeWarning, stacklevel=3)
            alpha = 0.0
        elif kappa <= 0.0:
            alpha = self.max_scale
        else:
            alpha = min(self.max_scale, math.sqrt(budget / kappa))
        record = {"step": self.steps + 1, "budget": budget, "kappa": kappa, "alpha": alpha,
                  "predicted_kl": alpha * alpha * kappa if math.isfinite(kappa) else kappa}
        self._pending = (record, logits.detach() if self.measure_realised else None, optimizer)
        return alpha

    def after_update(self) -> None:
        """Record the step (and the realised KL on the probe, if asked); called by the optimizer."""
        record, logits_old, optimizer = self._pending
        self._pending = None
        if logits_old is not None:
            model, inputs, mask, logits_fn = self._probe
            was_training = [(m, m.training) for m in model.modules()]
            try:
                model.eval()
                with torch.no_grad():
                    logits_new = logits_fn(_forward(model, inputs))
            finally:
                for m, mode in was_training:
                    m.training = mode
            record["realised_kl"] = mean_over_ranks(_divergences(logits_old, logits_new, mask),
                                                    optimizer)
        self.history.append(record)
        self.steps += 1

    @property
    def last(self) -> dict | None:
        """The latest step's record, or ``None`` before the first."""
        return self.history[-1] if self.history else None

    def state_dict(self) -> dict:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
