"""One GRPO run of one method: rollouts, loss, update, dev curve, memory and time."""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
from grpo.loss import group_advantages, grpo_loss
from grpo.memory import track
from grpo.model import answer_logprobs, response_mask
from grpo.rollout import accuracy, generate
from grpo.task import prompt_ids, rewards

from rgc.seeding import derive_seed


@dataclass(frozen=True)
class GRPOSettings:
    steps: int = 300
    prompts_per_step: int = 8
    group_size: int = 8
    temperature: float = 1.0
    kl_coef: float = 0.0
    eval_every: int = 25
    memory_steps: int = 2  # the first steps run under the memory tracker (and are not timed)


def run_grpo(method, train_qs, dev_qs, settings: GRPOSettings, *, seed: int, base_dev: float,
             reference=None, progress: bool = True, engine=None) -> dict:
    """Train ``method.policy`` with GRPO; return its dev curve and measured costs.

    Prompts and sampling noise come from ``seed`` and the step number only, so every method
    sees the same prompts and the same random numbers (a paired comparison). ``reference``
    (the frozen base) is needed only when ``settings.kl_coef > 0``. ``engine``: a
    :class:`grpo.engine.EngineRollouts` that samples the rollouts and follows each update
    (outside the memory tracker: the engine's memory is its own).
    """
    from tqdm import tqdm

    policy = method.policy
    n_prompts, group = settings.prompts_per_step, settings.group_size
    picker = torch.Generator().manual_seed(derive_seed(seed, "prompts"))
    curve = [(0, base_dev)]
    train_peak = loop_peak = 0
    step_times, train_times, rewards_mean, kls = [], [], [], []
    bar = tqdm(range(1, settings.steps + 1), desc=method.label, disable=not progress,
               leave=False)
    if engine is not None:
        engine.start(method)
    for step in bar:
        idx = torch.randint(len(train_qs), (n_prompts,), generator=picker).tolist()
        questions = [train_qs[i] for i in idx for _ in range(group)]
        measured = step <= settings.memory_steps
        held = method.held_tensors() + ([] if reference is None else
                                        list(reference.parameters()))
        engine_s, responses = 0.0, None
        if engine is not None:
            t_engine = time.perf_counter()
            responses = engine.generate(prompt_ids(questions), seed=seed, step=step,
                                        temperature=settings.temperature)
            engine_s = time.perf_counter() - t_engine
        with track(held) if measured else contextlib.nullcontext() as tracker:
            t0 = time.perf_counter()
            prompts = prompt_ids(questions)
            sampler = torch.Generator().manual_seed(derive_seed(seed, "rollout", step))
            policy.eval()
            if responses is None:
                responses = generate(policy, prompts, generator=sampler,
                                     temperature=settings.temperature)
            reward = rewards(questions, responses)
            advantages = group_advantages(reward, group)
            mask = response_mask(responses)
            ref_lp = None
            if settings.kl_coef > 0:
                with torch.no_grad():
                    ref_lp = answer_logprobs(reference, prompts, responses)
            if measured:
                loop_peak = max(loop_peak, tracker.peak)
                tracker.reset_peak()  # the training phase's own peak from here
            t1 = time.perf_counter()
            policy.train()
            logprobs = answer_logprobs(policy, prompts, responses)
            loss, info = grpo_loss(logprobs, logprobs.detach(), advantages, mask,
                                   ref_logprobs=ref_lp, kl_coef=settings.kl_coef)
            loss.backward()
            del logprobs, loss
            info.update(method.step(torch.cat([prompts, responses], dim=1)))
            t2 = time.perf_counter()
        if engine is not None:
            t_engine = time.perf_counter()
            engine.follow()
            engine_s += time.perf_counter() - t_engine
        if measured:
            train_peak = max(train_peak, tracker.peak)
            loop_peak = max(loop_peak, tracker.peak)
        else:
            step_times.append(t2 - t0 + engine_s)
            train_times.append(t2 - t1)
        rewards_mean.append(float(reward.mean()))
        kls.append(info.get("kl_to_base", 0.0))
        if step % settings.eval_every == 0 or step == settings.steps:
            curve.append((step, float(accuracy(policy, dev_qs).mean())))
            bar.set_postfix(dev=f"{curve[-1][1]:.3f}", reward=f"{rewards_mean[-1]:.2f}")
    policy.eval()
    engine_record = {} if engine is None else {"engine": {
        "bit_exact_at_end": engine.matches_policy(), "payloads": engine.payloads,
        "full_loads": engine.full_loads}}
    return {
        **engine_record,
        "label": method.label,
        "kind": method.kind,
        "dev_curve": curve,
        "final_dev": curve[-1][1],
        "train_reward": rewards_mean,
        "kl_to_base": kls,
        "train_peak_bytes": train_peak,
        "loop_peak_bytes": loop_peak,
        "s_per_step": statistics.median(step_times) if step_times else float("nan"),
        "train_s_per_step": statistics.median(train_times) if train_times else float("nan"),
        "trainable_params": method.trainable_params(),
        "extra_state_bytes": method.extra_state_bytes(),
    }
