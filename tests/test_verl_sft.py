"""verl's own SFT trainer (``torchrun -m verl.trainer.sft_trainer``, its Hydra config) trains a
tiny Qwen3 with rgc on 2 CPU processes, with the overrides of docs/verl.md.

Runs in .venv-verl (scripts/setup_verl.sh), skipped where verl is not installed. verl has no
CPU engine of its own: on the CPU platform its registry has only rgc's engine to give, so a run
that trains at all trained through it; the log shows the ``grad_norm`` rgc measured.
"""

from __future__ import annotations

import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (scripts/setup_verl.sh)")

# (tests/ is on sys.path, as for every test file; a package named tests in .venv-verl
# shadows the folder)
from test_verl_engine import VOCAB, _save_model  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 3
TIMEOUT_S = 180


def _data(path: Path) -> None:
    import pandas as pd

    gen = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(16):
        prompt, answer = (" ".join(f"t{int(t)}" for t in torch.randint(3, VOCAB, (n,),
                                                                         generator=gen))
                          for n in (4, 5))
        rows.append({"messages": [{"role": "user", "content": prompt},
                                  {"role": "assistant", "content": answer}]})
    pd.DataFrame(rows).to_parquet(path)


def _overrides(tmp: Path) -> list[str]:
    return [
        f"data.train_files={tmp / 'train.parquet'}", "data.train_batch_size=8",
        "data.micro_batch_size_per_gpu=2", "data.use_dynamic_bsz=False", "data.max_length=64",
        "data.num_workers=0",
        f"model.path={tmp / 'model'}", "model.external_lib=rgc.integrations.verl",
        "model.use_remove_padding=False", "+model.override_config.attn_implementation=eager",
        "engine.strategy=fsdp2", "engine.model_dtype=bfloat16", "engine.use_torch_compile=False",
        "optim.optimizer=RowAdam", "optim.lr=1e-3", "optim.clip_grad=1.0",
        "optim.override_optimizer_config={rank: 4, seed: 0}",
        f"trainer.total_training_steps={STEPS}", "trainer.logger=[console]",
        "trainer.device=cpu", "trainer.n_gpus_per_node=2",
        f"trainer.default_local_dir={tmp / 'ckpt'}",
    ]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path]:
    tmp = tmp_path_factory.mktemp("verl_sft")
    _save_model(tmp / "model")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp / "model")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    tok.save_pretrained(tmp / "model")
    _data(tmp / "train.parquet")
    env = dict(os.environ, VERL_USE_EXTERNAL_MODULES="rgc.integrations.verl",
               VERL_PLATFORM="cpu", VERL_ENGINE_VENDOR="rgc", OMP_NUM_THREADS="1")
    torchrun = Path(sys.executable).parent / "torchrun"
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m",
           "verl.trainer.sft_trainer", *_overrides(tmp)]
    proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and the trainers it started
        out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err), tmp


def test_verls_sft_trainer_trains_with_rgc(run):
    proc, tmp = run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    norms = [float(n) for n in re.findall(r"train/grad_norm:([0-9.e+-]+|nan|inf)", proc.stdout)]
    losses = [float(n) for n in re.findall(r"train/loss:([0-9.e+-]+)", proc.stdout)]
    assert len(norms) == STEPS, proc.stdout[-4000:]
    assert all(math.isfinite(n) and n > 0 for n in norms), norms
    assert len(losses) == STEPS
    saved = tmp / "ckpt" / f"global_step_{STEPS}"
    for rank in range(2):
        assert (saved / f"optim_world_size_2_rank_{rank}.pt").exists()
