"""A verl GRPO smoke run with rgc on a GPU: verl's PPO trainer, a vLLM rollout, rgc's engine.

A tiny random Qwen3 (word-level tokenizer with a chat template) and 64 arithmetic prompts
written to a temporary folder; ``python -m verl.trainer.main_ppo`` with the overrides of
docs/verl.md (RowAdam, clipping, ``sync: payload`` with rgc's rollout adapter and worker
extension, the engine kept awake) for ``--steps`` steps on the GPUs of this machine. Passes when
verl exits 0, logs a finite non-zero ``actor/grad_norm`` every step, and no payload was
refused after the first sync. Needs verl and vLLM (CUDA builds) in this Python; the log goes to
``--out``/verl_grpo_smoke.txt.

    python benchmarks/verl_grpo_smoke.py [--steps 3] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
    return float(ground_truth in solution_str.split())
'''
VOCAB = 64


def _write_inputs(folder: Path) -> None:
    import pandas as pd
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    )).to(torch.bfloat16).save_pretrained(folder / "model")
    words = ["<pad>", "<s>", "</s>", "user", "assistant", "plus", "is"] + [str(i) for i in
                                                                          range(VOCAB - 7)]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)},
                                     unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} "
                          "{% endfor %}{% if add_generation_prompt %}assistant {% endif %}")
    fast.save_pretrained(folder / "model")
    rows = [{"data_source": "arith", "prompt": [{"role": "user", "content": f"{a} plus {b} is"}],
             "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(a + b)},
             "extra_info": {"index": i}}
            for i, (a, b) in enumerate((a, b) for a in range(8) for b in range(8))]
    pd.DataFrame(rows).to_parquet(folder / "train.parquet")
    (folder / "reward.py").write_text(REWARD)


def ppo_overrides(folder: Path, steps: int, gpus: int) -> list[str]:
    """verl's PPO trainer overrides of the smoke run (inputs in ``folder``)."""
    a = "actor_rollout_ref"
    return [
        "algorithm.adv_estimator=grpo", f"data.train_files={folder}/train.parquet",
        f"data.val_files={folder}/train.parquet", "data.train_batch_size=16",
        "data.max_prompt_length=16", "data.max_response_length=8",
        f"{a}.model.path={folder}/model", f"{a}.model.external_lib=rgc.integrations.verl.rollout",
        f"{a}.actor.strategy=fsdp2", f"{a}.ref.strategy=fsdp2",
        f"{a}.actor.fsdp_config.model_dtype=bfloat16", f"{a}.actor.optim.optimizer=RowAdam",
        f"{a}.actor.optim.lr=1e-4", f"{a}.actor.optim.clip_grad=1.0",
        f"{a}.actor.optim.weight_decay=0.0",
        f"{a}.actor.optim.override_optimizer_config={{rank: 8, seed: 0, sync: payload}}",
        f"{a}.actor.ppo_mini_batch_size=8", f"{a}.actor.ppo_micro_batch_size_per_gpu=8",
        f"{a}.actor.use_kl_loss=False", f"{a}.rollout.name=vllm", f"{a}.rollout.n=4",
        f"{a}.rollout.tensor_model_parallel_size=1", f"{a}.rollout.gpu_memory_utilization=0.3",
        f"{a}.rollout.free_cache_engine=False", f"{a}.rollout.log_prob_micro_batch_size_per_gpu=8",
        f"{a}.ref.log_prob_micro_batch_size_per_gpu=8",
        f"+{a}.rollout.engine_kwargs.vllm.worker_extension_cls="
        "rgc.integrations.verl.worker.RGCVerlWorkerExtension",
        "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR=rgc",
        f"custom_reward_function.path={folder}/reward.py",
        "custom_reward_function.name=compute_score",
        "trainer.logger=[console]", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
        f"trainer.n_gpus_per_node={gpus}", "trainer.nnodes=1",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    import torch

    gpus = torch.cuda.device_count()
    folder = Path(tempfile.mkdtemp(prefix="rgc-verl-grpo-"))
    _write_inputs(folder)
    overrides = ppo_overrides(folder, args.steps, gpus)
    env = dict(os.environ, VERL_ENGINE_VENDOR="rgc")
    run = subprocess.run([sys.executable, "-m", "verl.trainer.main_ppo", *overrides], env=env,
                         capture_output=True, text=True, timeout=900)
    log = run.stdout + run.stderr
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "verl_grpo_smoke.txt").write_text(log)
    norms = [float(x) for x in re.findall(r"actor/grad_norm:([-+\w.]+)", log)]
    refused = log.count("refused rgc's payloads")
    ok = (run.returncode == 0 and len(norms) >= args.steps
          and all(math.isfinite(n) and n > 0 for n in norms) and refused == 0)
    print(f"verl GRPO smoke: exit {run.returncode}, grad_norm {norms}, payloads refused "
          f"{refused}: {'passed' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
