"""Rollouts from a vLLM engine kept at the policy's weights (``--vllm``; needs vLLM installed).

One in-process engine per worker process, on the CPU (or the GPU vLLM is built for), loaded
once with the base policy. Each run starts with a full load of its policy's weights; after
each update the engine follows the policy: the step's sketch-sized payload for RGC and
RowAdam (``export_update`` -> :func:`rgc.integrations.vllm.push_update`), the whole weights
for dense AdamW (:func:`~rgc.integrations.vllm.push_weights`). LoRA's adapters are not engine
weights, so ``--vllm`` runs without it. Sampling is vLLM's, seeded per prompt from the GRPO
seed and step, so every method sees the same random numbers (paired, as with the demo's own
sampler, but not the same numbers as it). Evaluation (greedy dev and test accuracy) stays on
the trained policy.
"""

from __future__ import annotations

import os
import tempfile

import torch
from grpo.task import EOS, MAX_ANSWER_LEN, PAD

from rgc.seeding import derive_seed

#: The methods whose weights the engine can follow.
ENGINE_METHODS = ("adamw", "adamw_proj", "rgc", "rowadam")


class EngineRollouts:
    """A vLLM engine that samples the rollouts of the run in progress.

    ``base``: the base policy (a BF16 transformers model), saved for the engine to load.
    """

    def __init__(self, base: torch.nn.Module):
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in-process
        from vllm import LLM

        import rgc.integrations.vllm  # noqa: F401  (before the engine: the CPU set-up)

        self._dir = tempfile.TemporaryDirectory(prefix="grpo-engine-")
        base.save_pretrained(self._dir.name)
        self.llm = LLM(model=self._dir.name, skip_tokenizer_init=True, enforce_eager=True,
                       dtype="bfloat16", max_model_len=base.config.max_position_embeddings,
                       kv_cache_memory_bytes=64 << 20, seed=0,
                       worker_extension_cls="rgc.integrations.vllm.RGCWorkerExtension")
        self.method = None
        self.payloads = self.full_loads = 0

    def start(self, method) -> None:
        """Load ``method``'s policy into the engine; RGC and RowAdam then keep their updates."""
        from rgc.integrations.vllm import push_weights

        if method.kind not in ENGINE_METHODS:
            raise ValueError(f"--vllm cannot follow {method.kind!r} (its weights are not the "
                             f"engine's); use one of {ENGINE_METHODS}")
        self.method = method
        opt = getattr(method, "opt", None)
        if opt is not None and hasattr(opt, "export_update"):
            opt.keep_updates = True
        push_weights(self.llm, method.policy)
        self.payloads, self.full_loads = 0, 1  # this run's syncs

    def follow(self) -> None:
        """After an update: the step's payload, or the whole weights."""
        from rgc.integrations.vllm import push_update, push_weights

        policy, opt = self.method.policy, getattr(self.method, "opt", None)
        if opt is not None and getattr(opt, "keep_updates", False):
            push_update(self.llm, opt.export_update(policy))
            self.payloads += 1
        else:
            push_weights(self.llm, policy)
            self.full_loads += 1

    def matches_policy(self) -> bool:
        """Whether the engine holds the policy's weights, bit for bit."""
        from rgc.integrations.vllm import read_weights

        params = dict(self.method.policy.named_parameters())
        engine = read_weights(self.llm, list(params))
        return all(torch.equal(engine[n].reshape(p.shape).cpu(), p.detach().cpu())
                   for n, p in params.items())

    def generate(self, prompts: torch.Tensor, *, seed: int, step: int,
                 temperature: float = 1.0, max_new: int = MAX_ANSWER_LEN) -> torch.Tensor:
        """(n, max_new) int64 responses to ``prompts`` (n, L), the end token kept, PAD after."""
        from vllm import SamplingParams

        requests = [{"prompt_token_ids": p.tolist()} for p in prompts]
        params = [SamplingParams(temperature=temperature, max_tokens=max_new,
                                 stop_token_ids=[EOS], detokenize=False,
                                 seed=derive_seed(seed, "rollout", step, i) % 2**31)
                  for i in range(len(requests))]
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        out = torch.full((len(requests), max_new), PAD, dtype=torch.int64)
        for i, o in enumerate(outputs):
            ids = list(o.outputs[0].token_ids)
            if o.outputs[0].finish_reason == "stop" and (not ids or ids[-1] != EOS):
                ids.append(EOS)
            ids = ids[:max_new]
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.int64)
        return out
