"""The training methods compared, each a small adapter over one policy model.

A method builds its policy from the base weights, says which tensors it holds between steps
(for the memory baseline), and turns the gradients (or sketches) of one backward pass into
an update. Rollouts, loss and evaluation are the same code for all of them.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from grpo.memory import storage_bytes
from grpo.model import ModelConfig
from grpo.task import PAD

import rgc

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# The 3-D expert weights of a Qwen3-MoE layer (peft's target_parameters names). Every method
# leaves the routers (mlp.gate) frozen, as rgc.wrap does by default: docs/demo.md says why.
EXPERT_STACKS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def is_target(name: str) -> bool:
    """Whether parameter ``name`` is trained by RGC, LoRA and dense AdamW on the projections:
    the weight of a ``TARGETS`` linear layer or an expert stack."""
    module, _, leaf = name.rpartition(".")
    return ((leaf == "weight" and module.rpartition(".")[2] in TARGETS)
            or name.endswith(tuple(f".{s}" for s in EXPERT_STACKS)))


def has_experts(model: torch.nn.Module) -> bool:
    return any(is_target(n) and p.dim() == 3 for n, p in model.named_parameters())


def linear_targets(model: torch.nn.Module) -> list[str]:
    """The ``TARGETS`` the model has as linear layers (peft reads a missing ``gate_proj`` and
    ``up_proj`` of an MoE model as the older name of its fused expert stack, at twice the rank)."""
    names = {n.rpartition(".")[2] for n, m in model.named_modules()
             if isinstance(m, torch.nn.Linear)}
    return [t for t in TARGETS if t in names]


# rgc.wrap matches an expert weight by its last name component (down_proj is in TARGETS too).
WRAP_TARGETS = sorted({*TARGETS, *(s.rpartition(".")[2] for s in EXPERT_STACKS)})


class Method:
    """Base: a BF16 policy loaded from the base weights; subclasses add the optimizer."""

    kind = ""
    name = ""  # in tables

    def __init__(self, base_state: dict, model_config: ModelConfig, *, lr: float, rank: int,
                 seed: int, steps: int):
        self.lr, self.rank, self.seed, self.steps = lr, rank, seed, steps
        self.policy = model_config.build(seed)
        self.policy.load_state_dict(base_state)
        self.base_bytes = storage_bytes([*self.policy.parameters(), *self.policy.buffers()])

    @property
    def label(self) -> str:
        return f"{self.kind} lr={self.lr:.3g}"

    def step(self, tokens: torch.Tensor) -> dict:
        """Apply the update from the last backward and clear it. tokens: the step's (n, L)."""
        raise NotImplementedError

    def state_tensors(self) -> Iterator[torch.Tensor]:
        """Tensors held between steps besides the policy's parameters and buffers."""
        return iter(())

    def held_tensors(self) -> list[torch.Tensor]:
        return [*self.policy.parameters(), *self.policy.buffers(), *self.state_tensors()]

    def trainable_params(self) -> int:
        return sum(p.numel() for p in self.policy.parameters() if p.requires_grad)

    def extra_state_bytes(self) -> int:
        """Bytes held between steps beyond the base policy's BF16 weights and buffers."""
        return storage_bytes(self.held_tensors()) - self.base_bytes


class DenseAdamW(Method):
    """Every parameter but the routers of an MoE policy trained by torch AdamW on an FP32 master
    copy; BF16 working weights.

    After backward (BF16 gradients) the gradients are copied to the FP32 masters, AdamW
    updates them, and the BF16 policy weights are overwritten by the rounded masters.
    """

    kind = "adamw"
    name = "dense AdamW"
    targets_only = False  # True: only the weights RGC trains (:func:`is_target`)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.targets_only:
            for name, p in self.policy.named_parameters():
                p.requires_grad_(is_target(name))
        for _, p in rgc.router_parameters(self.policy):
            p.requires_grad_(False)
        self.params = [p for p in self.policy.parameters() if p.requires_grad]
        self.master = [torch.nn.Parameter(p.detach().float()) for p in self.params]
        self.opt = torch.optim.AdamW(self.master, lr=self.lr, weight_decay=0.0)

    @torch.no_grad()
    def step(self, tokens):
        for p, m in zip(self.params, self.master, strict=True):
            m.grad = None if p.grad is None else p.grad.float()
            p.grad = None
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        for p, m in zip(self.params, self.master, strict=True):
            p.copy_(m)
        return {}

    def state_tensors(self):
        yield from self.master
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class DenseAdamWProjections(DenseAdamW):
    """Dense AdamW on the seven projection weights only (of an MoE policy: the attention
    projections and the expert stacks): the trainable set of RGC and LoRA.

    Embeddings, norms, routers and the output head stay frozen (no gradient, no master, no
    moments).
    """

    kind = "adamw_proj"
    name = "dense AdamW, 7 projections"
    targets_only = True

    @property
    def label(self):
        return f"adamw 7 projections lr={self.lr:.3g}"


class LoRA(Method):
    """peft LoRA (rank r, alpha 2r, no dropout) on the same targets; FP32 adapters, AdamW.

    On an MoE policy the expert stacks get peft's ``target_parameters`` adapters (rank r per
    expert); peft forms each stack's merged ``W + B A`` in every forward.
    """

    kind = "lora"
    name = "LoRA"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(self.seed)  # peft draws lora_A from torch's global generator
        config = LoraConfig(r=self.rank, lora_alpha=2 * self.rank, lora_dropout=0.0,
                            target_modules=linear_targets(self.policy),
                            target_parameters=EXPERT_STACKS if has_experts(self.policy) else None)
        self.policy = get_peft_model(self.policy, config)  # adapters in FP32 by default
        trainable = [p for p in self.policy.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=self.lr, weight_decay=0.0)

    @property
    def label(self):
        return f"lora r={self.rank} lr={self.lr:.3g}"

    def step(self, tokens):
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return {}

    def state_tensors(self):
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class RGC(Method):
    """rgc.wrap + RGCOptimizer; ``lr`` is the AdamW rate that calibrate_lr turns into tau.

    tau = ``tau_scale * rgc.calibrate_lr(policy, lr)`` (METHOD.md tries scales 1 and 3).
    Subclasses set ``refresh`` (the projection's schedule) and ``options`` (the optimizer's).
    """

    kind = "rgc"
    name = "RGC"
    refresh = "every_step"
    options: dict = {}

    def __init__(self, *args, tau_scale: float = 1.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.tau_scale = tau_scale
        rgc.wrap(self.policy, self.rank, targets=WRAP_TARGETS, seed=self.seed,
                 refresh=self.refresh)
        self.tau = tau_scale * rgc.calibrate_lr(self.policy, self.lr)
        self.opt = rgc.RGCOptimizer([p for p in self.policy.parameters() if p.requires_grad],
                                    lr=self.tau, seed=self.seed, **self.options)

    @property
    def label(self):
        return f"{self.kind} r={self.rank} tau={self.tau_scale:g}x ({self.tau:.3g})"

    def step(self, tokens):
        self.opt.step()  # also zeroes the sketches, keeping their storage
        return {}

    def state_tensors(self):
        yield from sketches(self.policy)
        yield from (s["momentum_buffer"] for s in self.opt.state.values()
                    if "momentum_buffer" in s)


class RGCMomentum(RGC):
    """RGC with heavy-ball momentum 0.9 in sketch space; P refreshed every 10 updates (the
    buffer carried into each new basis). Its base rate is a third of RGC's (the experiment's
    ``lr``): the steps within one basis point alike, so they add up rather than cancel."""

    kind = "rgc_momentum"
    name = "RGC + momentum"
    refresh = 10
    options = {"momentum": 0.9}


class RGCNesterov(RGC):
    """As :class:`RGCMomentum`, with Nesterov's variant."""

    kind = "rgc_nesterov"
    name = "RGC + Nesterov"
    refresh = 10
    options = {"momentum": 0.9, "nesterov": True}


class RGCRows(RGC):
    """RGC with every row of the direction at the same norm (``row_norm``), P refreshed every
    step: no state."""

    kind = "rgc_rows"
    name = "RGC, rows"
    options = {"row_norm": True}


class RGCNesterovRows(RGC):
    """:class:`RGCNesterov` with rows of equal norm."""

    kind = "rgc_nesterov_rows"
    name = "RGC + Nesterov, rows"
    refresh = 10
    options = {"momentum": 0.9, "nesterov": True, "row_norm": True}


class RowAdam(Method):
    """rgc.RowAdam on a fixed Rademacher basis with predicted-KL step control (LoGRA-style).

    The probe batch of the KL prediction is the first ``probe`` sequences of the step (prompt
    and response), averaged over their non-padding tokens; the budget anneals from 2e-4 to
    2e-5 over the run, as in the LoGRA paper. Subclasses set ``wrap_options`` (rgc.wrap's
    projection and refresh) and ``controlled`` (whether the KL controller scales the steps).
    """

    kind = "rowadam"
    name = "RowAdam + predicted KL"
    probe = 16
    wrap_options: dict = {"preset": "logra"}
    controlled = True
    label_suffix = "+KL"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        rgc.wrap(self.policy, self.rank, targets=WRAP_TARGETS, seed=self.seed,
                 **self.wrap_options)
        self.control = (rgc.PredictedKL(budget=2e-4, final_budget=2e-5,
                                        anneal_steps=self.steps) if self.controlled else None)
        self.opt = rgc.RowAdam([p for p in self.policy.parameters() if p.requires_grad],
                               lr=self.lr, seed=self.seed, step_control=self.control)

    @property
    def label(self):
        return f"rowadam r={self.rank} lr={self.lr:.3g} {self.label_suffix}"

    def step(self, tokens):
        if self.control is not None:
            probe = tokens[:self.probe]
            self.control.set_probe(self.policy, probe, token_mask=probe != PAD)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        last = (self.control.last if self.control is not None else None) or {}
        return {k: last[k] for k in ("alpha", "predicted_kl", "realised_kl") if k in last}

    def state_tensors(self):
        yield from sketches(self.policy)
        for state in self.opt.state.values():
            yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class RowAdamPlain(RowAdam):
    """rgc.RowAdam on RGC's orthonormal projections refreshed every 10 updates (the first
    moment carried into each new basis), without step control: per-row second moments on the
    sketch at an Adam rate."""

    kind = "rowadam_plain"
    name = "RowAdam, refreshed P"
    wrap_options = {"refresh": 10}
    controlled = False
    label_suffix = "P/10"


def sketches(policy) -> Iterator[torch.Tensor]:
    """The FP32 sketches of every sketched weight (linear layers and expert stacks)."""
    for _, owner in rgc.sketched_weights(policy):
        if owner.sketch is not None:
            yield owner.sketch


METHODS: dict[str, type[Method]] = {"adamw": DenseAdamW, "adamw_proj": DenseAdamWProjections,
                                     "lora": LoRA, "rgc": RGC, "rowadam": RowAdam,
                                     "rgc_momentum": RGCMomentum, "rgc_nesterov": RGCNesterov,
                                     "rgc_rows": RGCRows, "rgc_nesterov_rows": RGCNesterovRows,
                                     "rowadam_plain": RowAdamPlain}
