"""GRPO: group-normalised advantages and the token-level policy-gradient loss."""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """(n,) FP32 advantages ``(r - mean_group) / (std_group + eps)``.

    rewards: (n,) with ``n = prompts * group_size``, the responses of one prompt adjacent.
    A group whose responses all score the same gets advantage 0 (no signal).
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.view(-1, group_size).to(torch.float32)
    adv = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)
    return adv.view(-1)


def grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
              mask: torch.Tensor, *, ref_logprobs: torch.Tensor | None = None,
              kl_coef: float = 0.0, clip: float = 0.2) -> tuple[torch.Tensor, dict]:
    """Token-level clipped policy-gradient loss with an optional KL penalty to the base.

    All (n, T) FP32 except ``advantages`` (n,). Every response token counts equally (the sum
    over all tokens is divided by the number of tokens in the batch, not per response). The KL
    term is the non-negative ``k3`` estimator ``exp(q - p) - (q - p) - 1`` with q the base's
    log-probability. With one update per batch of rollouts the ratio is 1 and the clip inactive;
    the gradient is then ``-A * grad log p``.
    """
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    per_token = pg
    kl = torch.zeros((), dtype=torch.float32)
    if kl_coef > 0.0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs ref_logprobs (the base policy's log-probs)")
        d = ref_logprobs - logprobs
        kl_tok = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl_tok
        kl = (kl_tok * mask).sum() / mask.sum()
    loss = (per_token * mask).sum() / mask.sum()
    return loss, {"kl_to_base": float(kl)}
