"""XTuner v1's real ``Trainer.fit()`` on CPU ranks, for test_xtuner_trainer.py.

Importing this module imports XTuner's trainer once (seconds); ``launch`` then forks the ranks
of a DP 2 x SP 2 job from this process, so no rank pays for the import again, and runs several
arms (trainers, one after the other) in each rank. Each rank records, per step: the model input
after the SP split, the loss, the grad norm and ``torch.get_rng_state()`` after the data fetch
and after the optimizer step; and after ``fit()`` its shards of the parameters and how often it
created a DataLoader iterator. ``launch`` returns the records of every arm and rank.
``leader_dies`` is one rank of test_xtuner_trainer.py's kill test.

XTuner itself is unchanged. The shims below only make it run on a CPU-only torch; each says
which XTuner call needs it. The model is XTuner's dense Qwen3 shrunk to one layer of hidden
size 64 with the test tokenizer's vocabulary, with XTuner's own eager attention and fp32 FSDP2
on a CPU mesh.
"""

import dataclasses
import datetime
import glob
import itertools
import os
import signal
import sys
import time
import types

import xtuner_pipeline as xp  # noqa: F401 - XTuner's data code, its datasets package bare
from dist_harness import wait_for_every_rank

# Import-time shims. XTuner's writer package imports its TensorBoard writer, which imports
# torch.utils.tensorboard (the tensorboard package, not installed); the jsonl tracker the test
# uses needs neither.
_tensorboard = types.ModuleType("torch.utils.tensorboard")
_tensorboard.SummaryWriter = None
sys.modules.setdefault("torch.utils.tensorboard", _tensorboard)
# The trainer imports set_random_seed from mmengine.runner, whose package imports its image hooks,
# which import OpenCV (not installed; nothing the trainer runs calls it).
_cv2 = types.ModuleType("cv2")


def _no_opencv(name):
    raise AttributeError(f"cv2.{name}: OpenCV is not installed (a stub for mmengine's imports)")


_cv2.__getattr__ = _no_opencv
sys.modules.setdefault("cv2", _cv2)
# xtuner.v1.rl.utils's __init__ imports ray; the trainer needs only plain submodules of it.
xp._bare_package("xtuner.v1.rl")
xp._bare_package("xtuner.v1.rl.utils")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from xtuner.v1.config import AdamWConfig, FSDPConfig, LRConfig  # noqa: E402
from xtuner.v1.model.dense.qwen3 import Qwen3DenseConfig  # noqa: E402
from xtuner.v1.module.attention import MHAConfig  # noqa: E402
from xtuner.v1.train.trainer import LoadCheckpointConfig, Trainer  # noqa: E402

import peer_death  # noqa: E402
import peer_death_ranks  # noqa: E402
import spbcast  # noqa: E402
import spbcast.xtuner  # noqa: E402

SEED = 11
DP, SP = 2, 2
WORLD = DP * SP


def _cpu_runtime_shims():
    """What XTuner main calls on an accelerator that a CPU-only torch lacks."""
    # Trainer._init_dist calls torch.accelerator.set_device_index unconditionally; with no
    # accelerator it raises (a CPU wheel has none; a CUDA build, as PyPI's torch 2.9.1, names
    # CUDA as its accelerator but has no device here, and initializing it in the forked rank fails).
    if not torch.accelerator.is_available():
        torch.accelerator.set_device_index = lambda index: None
        # ... and puts its warm-up tensor on torch.accelerator.current_accelerator(): the CPU.
        torch.accelerator.current_accelerator = lambda *args, **kwargs: None
    # XTuner's CPU device module is torch.cpu; fit(), _log_step and _maybe_save call these
    # CUDA memory statistics on it.
    for name, value in (("empty_cache", None), ("reset_peak_memory_stats", None),
                        ("max_memory_allocated", 0), ("max_memory_reserved", 0)):
        if not hasattr(torch.cpu, name):
            setattr(torch.cpu, name, lambda *args, _value=value, **kwargs: _value)


def tiny_qwen3(vocab_size):
    return Qwen3DenseConfig(
        vocab_size=vocab_size, max_position_embeddings=512, bos_token_id=2, eos_token_id=3,
        pad_token_id=1, num_hidden_layers=1, max_window_layers=1, hidden_size=64,
        intermediate_size=128, rms_norm_eps=1e-6, hidden_act="silu", tie_word_embeddings=False,
        attention=MHAConfig(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            qk_norm=True, attn_impl="eager_attention"))


def write_inputs(directory):
    """The tokenizer as a Hugging Face tokenizer directory and the pretraining samples."""
    tokenizer_dir = os.path.join(directory, "tokenizer")
    xp.make_tokenizer().save_pretrained(tokenizer_dir)
    data = xp.write_text_data(directory, n=18, seed=3)
    return tokenizer_dir, data


@dataclasses.dataclass
class Arm:
    """One training run: a name, the switch, the loader workers, and what it resumes from
    (another arm's name and a step) or where it saves; ``extra_draw`` makes every SP follower
    draw once more from the default generator at that step (the negative control)."""
    name: str
    dedup: bool
    workers: int = 0
    resume: tuple[str, int] | None = None
    extra_draw: int | None = None
    hand_wired: bool = False  # dedup wired by hand, as before the switch (its checkpoints)
    pack_max_length: int = 64  # another than the checkpoint's: a data config it does not fit
    checkpoint_interval: int | None = 1


class HandWiredDataloaderConfig(xp.DataloaderConfig):
    """XTuner's config whose dataloader is wrapped in spbcast.LeaderLoader by hand, as
    docs/xtuner.md showed before the switch existed: its checkpoints hold LeaderLoader's own
    state, which the switch must keep loading."""

    def build(self, **kwargs):
        dataloader = super().build(**kwargs)
        sp_group = spbcast.xtuner._root_mesh(kwargs["dp_mesh"])["sp"].get_group()
        return spbcast.LeaderLoader(lambda: dataloader, sp_group, sp_media_dedup=True,
                                    first_epoch=1, set_epoch=None)


def checkpoint_of(root, arm_name, step):
    found = glob.glob(os.path.join(root, arm_name, "work", "*", "checkpoints", f"ckpt-step-{step}"))
    assert len(found) == 1, f"arm {arm_name}: checkpoint of step {step}: {found}"
    return found[0]


def snapshot(value):
    """A picklable copy of what the model receives: tensors cloned with their layout, XTuner's
    dataclasses as (class name, fields), meshes by their ranks."""
    if isinstance(value, torch.Tensor):  # the values, and the layout the model got them in
        local = value.to_local() if isinstance(value, DTensor) else value
        return ("tensor", local.detach().clone(), local.stride(), local.storage_offset(),
                value.requires_grad)
    if isinstance(value, (list, tuple)):
        return type(value)(snapshot(v) for v in value)
    if isinstance(value, dict):
        return {k: snapshot(v) for k, v in value.items()}
    if isinstance(value, (torch.device, torch.dtype)):
        return str(value)
    if hasattr(value, "mesh") and hasattr(value, "mesh_dim_names"):
        return ("DeviceMesh", value.mesh.tolist())
    if dataclasses.is_dataclass(value) or hasattr(value, "__dict__"):
        fields = vars(value) if not dataclasses.is_dataclass(value) else {
            f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
        return (type(value).__name__, {k: snapshot(v) for k, v in fields.items()
                                       if not callable(v) and not k.startswith("__")})
    return value


def make_trainer(arm, root, tokenizer_dir, data):
    """XTuner's Trainer for one arm, built as a user builds it (a resumed arm loads its checkpoint
    here, inside Trainer(...))."""
    work = os.path.join(root, arm.name, "work")
    xp.use_cache_dir(os.path.join(root, arm.name, "cache"))
    load = LoadCheckpointConfig()
    if arm.resume is not None:
        load = LoadCheckpointConfig(checkpoint_path=checkpoint_of(root, *arm.resume))
    config = dict(num_workers=arm.workers, pack_max_length=arm.pack_max_length)
    if arm.hand_wired:
        loader_cfg = xp.text_config(data, config_class=HandWiredDataloaderConfig, **config)
    else:
        loader_cfg = xp.text_config(data, sp_media_dedup=arm.dedup,
                                    config_class=spbcast.xtuner.DataloaderConfig, **config)
    return Trainer(
        model_cfg=tiny_qwen3(len(xp.SPECIAL) + len(xp.WORDS)),
        optim_cfg=AdamWConfig(lr=1e-3, foreach=False),
        fsdp_cfg=FSDPConfig(torch_compile=False, param_dtype=torch.float32,
                            reduce_dtype=torch.float32),
        dataloader_cfg=loader_cfg, lr_cfg=LRConfig(lr_type="constant", warmup_ratio=0),
        tokenizer_path=tokenizer_dir, global_batch_size=DP, sp_size=SP, total_epoch=2,
        work_dir=work, seed=SEED, backend="gloo", exp_tracker="jsonl",
        checkpoint_interval=arm.checkpoint_interval if arm.resume is None else None,
        load_checkpoint_cfg=load)


def _train(arm, root, tokenizer_dir, data, rank):
    """One arm in this rank: XTuner's Trainer built and fit() as a user runs it, recorded."""
    record = {"steps": [], "iterators": 0}
    original_iter = torch.utils.data.DataLoader.__iter__

    def counting_iter(self):
        record["iterators"] += 1
        return original_iter(self)

    torch.utils.data.DataLoader.__iter__ = counting_iter
    try:
        trainer = make_trainer(arm, root, tokenizer_dir, data)
        sp_rank = trainer.sp_mesh.get_local_rank()
        prepare, engine = trainer._prepare_model_input, trainer._engine
        train_step, clip, step_optimizer = engine.train_step, engine.clip_grad_norm, engine.step_optimizer

        def recorded_prepare(data_batch):
            step = {"cur_step": trainer.cur_step, "epoch": trainer.cur_epoch}
            if arm.extra_draw == trainer.cur_step and sp_rank != 0:
                torch.rand(1)
            step["rng_after_fetch"] = torch.get_rng_state()
            engine_input = prepare(data_batch)
            step["model_input"] = snapshot(engine_input)
            record["steps"].append(step)
            return engine_input

        def recorded_train_step(engine_input):
            info = train_step(engine_input)
            record["steps"][-1]["loss"] = (info["total_loss"], snapshot(info["logs_info"]))
            return info

        def recorded_clip(*args, **kwargs):
            norm = clip(*args, **kwargs)
            record["steps"][-1]["grad_norm"] = snapshot(norm)
            return norm

        def recorded_step_optimizer(grad_norm):
            out = step_optimizer(grad_norm)
            record["steps"][-1]["rng_after_step"] = torch.get_rng_state()
            return out

        trainer._prepare_model_input = recorded_prepare
        engine.train_step, engine.clip_grad_norm = recorded_train_step, recorded_clip
        engine.step_optimizer = recorded_step_optimizer
        record["total_step"] = trainer.total_step
        trainer.fit()
        record["params"] = {name: snapshot(p) for name, p in engine.model.named_parameters()}
        record["loader_len"] = len(trainer._dataloader)
        stats = getattr(trainer._dataloader, "stats", None)
        record["prefetch"] = stats()["prefetch"] if callable(stats) else None
    finally:
        torch.utils.data.DataLoader.__iter__ = original_iter
    return record


def _rank_environment(rank):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), XTUNER_LOG_LEVEL="WARNING")
    transformers.logging.set_verbosity_error()  # its warnings about XTuner's rope keys
    torch.set_num_threads(1)
    _cpu_runtime_shims()


def _rank_main(rank, tag, root, fn, backend):
    _rank_environment(rank)
    # The trainer's _init_dist keeps a process group that is already initialized: a FileStore
    # in the test's directory, so no port is chosen.
    dist.init_process_group(backend, init_method=f"file://{os.path.join(root, 'store-' + tag)}",
                            rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    wait_for_every_rank(os.path.join(root, "set-up-" + tag), WORLD)
    result = fn(rank)
    torch.save(result, os.path.join(root, f"result-{tag}-rank{rank}.pt"))
    dist.destroy_process_group()


def fork_ranks(root, tag, fn, backend="gloo", timeout=240):
    """Forks the WORLD ranks of one job; each initializes the default process group and returns
    fn(rank). Returns the results by rank; a rank that fails (or a job past ``timeout``) stops
    the others and fails with every failed rank's traceback."""
    children = {}
    for rank in range(WORLD):
        child = peer_death.ForkedRank(rank, lambda r, out: _rank_main(r, tag, root, fn, backend), root)
        children[child.pid] = rank
    failed, deadline = [], time.monotonic() + timeout
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                failed.append(f"ranks {sorted(children.values())} still running after {timeout} s")
                for p in children:
                    os.kill(p, signal.SIGKILL)
            time.sleep(0.05)
            continue
        rank = children.pop(pid)
        if os.waitstatus_to_exitcode(status) != 0:
            failed.append(f"rank {rank} failed")
            for p in children:  # the others would wait for it in a collective
                os.kill(p, signal.SIGKILL)
    if failed:
        errors = [f"--- rank {rank}:\n" + open(path).read() for rank in range(WORLD)
                  if os.path.exists(path := os.path.join(root, f"error-rank{rank}.txt"))]
        raise AssertionError("; ".join(failed) + ":\n" + "\n".join(errors))
    return [torch.load(os.path.join(root, f"result-{tag}-rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]


def launch(root, arms, tokenizer_dir, data):
    """One job whose ranks run ``arms`` in turn; returns {arm: [record per rank]}."""
    def run_arms(rank):
        records = {}
        for arm in arms:
            records[arm.name] = _train(arm, root, tokenizer_dir, data, rank)
            dist.barrier()
        return records

    per_rank = fork_ranks(root, arms[0].name, run_arms)
    return {arm.name: [records[arm.name] for records in per_rank] for arm in arms}


def leader_dies(root, tokenizer_dir, data, workers, rank, out):
    """One rank of the kill test (forked by peer_death.fork): XTuner's fit() under the switch,
    whose SP leader rank 0 SIGKILLs itself 0.2 s after it asks for step 3's batch. Its packs take
    FETCH_SECONDS each to read, far longer than a step, so that batch is not sent yet and its SP
    follower waits in the loader too, where spbcast is the one to see the death; killed in the
    middle of the model's own collectives, the follower would get the backend's error first.
    Each survivor records what it raised (peer_death_ranks.survive)."""
    _rank_environment(rank)
    peer_death_ranks.join_group(rank, WORLD, out)
    peer_death_ranks.slow_down(sys.modules["xtuner.v1.datasets.packing"]._LegacySoftPackDataset, "__getitem__",
                               FETCH_SECONDS)
    trainer = make_trainer(Arm("dies", True, workers=workers, checkpoint_interval=None), root, tokenizer_dir, data)
    data_iter = trainer._data_iter

    def dying_data_iter():
        batches = data_iter()
        for step in itertools.count(1):
            if rank == 0 and step == 3:
                peer_death_ranks.end_myself(out, signal.SIGKILL, when=0.2)
            batch = next(batches, None)
            if batch is None:
                return
            yield batch

    trainer._data_iter = dying_data_iter
    peer_death_ranks.survive(out, rank, trainer.fit, dist.destroy_process_group)


FETCH_SECONDS = 3.0
