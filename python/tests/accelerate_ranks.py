"""Hugging Face accelerate's own loop and transformers' real ``Trainer.train()`` on 4 CPU ranks, for
test_accelerate.py.

Importing this module imports accelerate and transformers once (seconds); ``run_arms`` then forks
the 4 ranks of one job from this process and runs several arms (runs, one after the other) in each
rank: BASE (accelerate as shipped) and dedup (``spbcast.accelerate.enable``). Every rank is given
the same CPU device mesh, (dp_shard 2, tp 2) or (dp_shard 2, cp 2), as
``accelerator.state.device_mesh`` - accelerate refuses a ParallelismConfig on a CPU-only run, so
the mesh is set and nothing else changes: the ranks of a TP (CP) pair share a data index, as on
GPUs. Each rank records what the loop saw, step by step.

Nothing of accelerate or the Trainer is replaced. The one shim, the same in BASE and dedup: on CPU
with several processes the Trainer's device is ``cpu:<index>``, which its resume gives
``torch.load`` as ``map_location`` and torch cannot restore storages to; it is read as "cpu".
"""

import copy
import dataclasses
import functools
import multiprocessing
import os
import time

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.state import AcceleratorState, GradientState
from accelerate.utils import set_seed
from torch.distributed.device_mesh import init_device_mesh
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import seed_worker

import dist_harness
import spbcast
import spbcast.accelerate

WORLD = 4
# The meshes an arm runs under: (dp_shard 2, tp 2) or (dp_shard 2, cp 2). Either way ranks (0, 1)
# and (2, 3) share a data index (accelerate: process_index // (tp * cp)).
MESHES = {dim: (("dp_shard", 2), (dim, 2)) for dim in ("tp", "cp")}
LEADERS, FOLLOWERS = (0, 2), (1, 3)  # the TP (or CP) pairs (0, 1) and (2, 3)
SEED = 7
# Neither a multiple of the global batch (2 per device x 2 data indices): accelerate pads the last.
SAMPLES = 11  # accelerate's loop: 3 batches a rank, an epoch
TRAINER_SAMPLES = 22  # the Trainer: 6 batches, 3 optimizer steps an epoch
MID = 2  # the Trainer's checkpoint (save_steps): mid-epoch; a loop's save_state after that step


class Samples(torch.utils.data.Dataset):
    """Deterministic samples (a token sequence and a float feature per index); ``noise`` adds
    draws from the default CPU generator where the sample is read - in a DataLoader worker, which
    the Trainer seeds by global rank. ``fetches`` counts the reads of every process of this rank,
    its workers included."""

    def __init__(self, n=SAMPLES, noise=False):
        self.n, self.noise = n, noise
        self.fetches = multiprocessing.get_context("fork").Value("i", 0)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        with self.fetches.get_lock():
            self.fetches.value += 1
        ids = torch.randint(0, 64, (8,), generator=torch.Generator().manual_seed(i))
        if self.noise:  # a random augmentation, drawn where the sample is read
            ids[torch.randint(0, 8, (2,))] = torch.randint(0, 64, (2,))
        return {"input_ids": ids, "labels": ids.clone(), "x": torch.full((3,), float(i))}


def _fresh_accelerate():
    """A new run in a process that ran one before: accelerate's singletons as in a new process."""
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def _clone(batch):
    return {k: v.clone() for k, v in batch.items()}


# ---- accelerate's own loop ----------------------------------------------------------------------


@dataclasses.dataclass
class LoopArm:
    """One run of accelerate's own loop: 2 epochs with gradient accumulation 2, then a pass of
    ``skip_first_batches(loader, 2)`` (not for a stateful loader, which accelerate says not to
    skip). ``stateful``: use_stateful_dataloader with a seedable sampler, data_seed and uneven
    batches, and ``accelerator.save_state`` after step MID; ``resume``: the arm whose saved state
    it loads (accelerator.load_state) before iterating; ``expect_error``: the run is a refusal."""
    name: str
    dedup: bool
    workers: int = 0
    noise: bool = False
    stateful: bool = False
    resume: str | None = None
    mesh: bool = True
    dispatch: bool = False
    options: dict = dataclasses.field(default_factory=dict)
    expect_error: bool = False
    shared_dim: str = "tp"  # the mesh dimension whose ranks share a data index: "tp" or "cp"


def _loop(arm, rank, mesh, root):
    _fresh_accelerate()
    config = DataLoaderConfiguration(use_stateful_dataloader=arm.stateful, use_seedable_sampler=arm.stateful,
                                     data_seed=3 if arm.stateful else None,
                                     even_batches=not arm.stateful, dispatch_batches=arm.dispatch or None)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, dataloader_config=config)
    if arm.mesh:
        accelerator.state.device_mesh = mesh
    if arm.dedup:
        spbcast.accelerate.enable(accelerator, **arm.options)
    set_seed(SEED)
    data = Samples(noise=arm.noise)
    loader = torch.utils.data.DataLoader(  # workers seeded by global rank, as the Trainer seeds them
        data, batch_size=2, shuffle=True, num_workers=arm.workers,
        worker_init_fn=functools.partial(seed_worker, num_workers=arm.workers, rank=rank))
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # A StatefulDataLoader with workers reads its first samples already here, on every rank:
    # accelerate takes its state_dict() as it wraps it, which in torchdata starts its iterator.
    record = {"steps": [], "fetches_in_prepare": data.fetches.value}
    if arm.resume is not None:
        accelerator.load_state(os.path.join(root, arm.resume, "state"))
    state = accelerator.gradient_state

    def take(batch, epoch):
        with accelerator.accumulate(model):
            accelerator.backward(model(batch["x"]).sum())
            optimizer.step()
            optimizer.zero_grad()
        step = {"epoch": epoch, "batch": _clone(batch), "end": state.end_of_dataloader,
                "remainder": state.remainder, "sync": accelerator.sync_gradients, "rng": torch.get_rng_state()}
        if arm.stateful:
            step["state"] = copy.deepcopy(loader.state_dict())
        record["steps"].append(step)
        if arm.stateful and arm.resume is None and len(record["steps"]) == MID:
            _save_state_in_turn(accelerator, os.path.join(root, arm.name, "state"))

    for epoch in range(2):
        for batch in loader:
            take(batch, epoch)
    if not arm.stateful:
        for batch in accelerator.skip_first_batches(loader, 2):
            take(batch, "skipped")
    stats = spbcast.accelerate.stats(loader)  # None: accelerate's loader, untouched
    record.update(len=len(loader), fetches=data.fetches.value, shared=stats is not None,
                  prefetch=stats["prefetch"] if stats is not None else None,
                  params=[p.detach().clone() for p in model.parameters()], rng=torch.get_rng_state())
    return record


def _save_state_in_turn(accelerator, directory):
    """accelerator.save_state, one rank after the other: in accelerate 1.15 every process writes
    the loader's state to the same file (dl_state_dict.bin), which ranks writing at once corrupt
    (BASE and dedup alike). save_state has no collective of its own on CPU."""
    for rank in range(WORLD):
        if rank == dist.get_rank():
            accelerator.save_state(directory)
        dist.barrier()


# ---- transformers' Trainer ----------------------------------------------------------------------


@dataclasses.dataclass
class TrainerArm:
    """One ``Trainer.train()``: a Llama of one layer from a config, 2 epochs of TRAINER_SAMPLES
    with gradient accumulation 2, a checkpoint every MID optimizer steps; ``resume``: the arm
    whose checkpoint-MID it resumes from (new processes)."""
    name: str
    dedup: bool
    workers: int = 0
    noise: bool = False
    resume: str | None = None
    shared_dim: str = "tp"


class _Recorder(TrainerCallback):
    def __init__(self, record):
        self.record = record

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.record["len"] = len(train_dataloader)

    def on_train_end(self, args, state, control, train_dataloader=None, **kwargs):
        stats = spbcast.accelerate.stats(train_dataloader)  # None: accelerate's loader, untouched
        self.record["prefetch"] = stats["prefetch"] if stats is not None else None

    def on_step_end(self, args, state, control, **kwargs):
        self.record["optimizer_steps"].append({"global_step": state.global_step, "rng": torch.get_rng_state()})


def _cpu_map_location():
    """The Trainer's resume calls torch.load(map_location=args.device), here cpu:<index>, which torch
    cannot restore storages to: a CPU device is read as "cpu" (BASE and dedup alike)."""
    load = torch.load

    def cpu_load(*args, map_location=None, **kwargs):
        if map_location is not None and torch.device(map_location).type == "cpu":
            map_location = "cpu"
        return load(*args, map_location=map_location, **kwargs)

    torch.load = cpu_load


def checkpoint(root, arm_name):
    return os.path.join(root, arm_name, f"checkpoint-{MID}")


def _train(arm, rank, mesh, root, enable=None):
    model = tiny_llama()
    args = TrainingArguments(output_dir=os.path.join(root, arm.name), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=2, save_strategy="steps",
                             save_steps=MID, logging_strategy="no", use_cpu=True, seed=SEED, report_to=[],
                             dataloader_num_workers=arm.workers, disable_tqdm=True)
    data = Samples(TRAINER_SAMPLES, noise=arm.noise)
    record = {"micro_steps": [], "optimizer_steps": []}
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[_Recorder(record)])
    train_recorded(trainer, arm, mesh, root, record, enable)
    record["fetches"] = data.fetches.value
    return record


def tiny_llama(vocab_size=64):
    """A Llama of one layer from a config (no download), the same weights in every process."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                        max_position_embeddings=16))


def train_recorded(trainer, arm, mesh, root, record, enable=None):
    """The mesh given to the trainer's accelerator, spbcast's line under dedup (``enable(trainer)``
    where given), then train() (or the resume from ``arm.resume``'s checkpoint-MID), recording per
    micro-step the inputs and the loss, the grad norm per optimizer step, and at the end the
    generator and the parameters."""
    trainer.accelerator.state.device_mesh = mesh
    if arm.dedup and enable is not None:
        enable(trainer)
    elif arm.dedup:
        spbcast.accelerate.enable(trainer.accelerator)  # the documented line
    training_step, clip = trainer.training_step, trainer._clip_grad_norm

    def recorded_training_step(model, inputs, *args, **kwargs):
        loss = training_step(model, inputs, *args, **kwargs)
        record["micro_steps"].append({"inputs": _clone(inputs), "loss": loss.detach().clone()})
        return loss

    def recorded_clip(model):
        norm = clip(model)
        record["micro_steps"][-1]["grad_norm"] = norm.detach().clone()
        return norm

    trainer.training_step, trainer._clip_grad_norm = recorded_training_step, recorded_clip
    trainer.train(resume_from_checkpoint=checkpoint(root, arm.resume) if arm.resume else None)
    record.update(rng=torch.get_rng_state(),
                  params={name: p.detach().clone() for name, p in trainer.model.named_parameters()})


# ---- the job ------------------------------------------------------------------------------------


RUNNERS = {LoopArm: _loop, TrainerArm: _train}  # arm type -> run(arm, rank, mesh, root); trl_ranks.py adds its own


def _run(arm, rank, mesh, root):
    """One arm in this rank: its record, or for a refusal what it raised."""
    run = RUNNERS[type(arm)]
    if not getattr(arm, "expect_error", False):
        return run(arm, rank, mesh, root)
    try:
        run(arm, rank, mesh, root)
    except spbcast.Error as e:
        return {"error": str(e), "type": type(e).__name__}
    return {"error": None}


def _environment(rank):
    # What a launcher sets (accelerate reads the CPU job's layout from it); one thread a rank.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD), OMP_NUM_THREADS="1")
    transformers.logging.set_verbosity_error()
    _cpu_map_location()


def _rank(rank, world, root, tag, arms):
    meshes = {dim: init_device_mesh("cpu", tuple(size for _, size in mesh), mesh_dim_names=tuple(n for n, _ in mesh))
              for dim, mesh in MESHES.items() if any(arm.shared_dim == dim for arm in arms)}
    records = {}
    for arm in arms:
        started = time.monotonic()
        records[arm.name] = _run(arm, rank, meshes[arm.shared_dim], root)
        records[arm.name]["seconds"] = time.monotonic() - started
        dist.barrier()
    torch.save(records, os.path.join(root, f"records-{tag}-rank{rank}.pt"))


def run_arms(root, tag, arms, timeout=150):
    """Forks one job of WORLD ranks (dist_harness.run: Gloo over a FileStore) whose ranks run
    ``arms`` in turn; returns {arm name: [record per rank]}. A rank that fails fails the job with
    its traceback; a job past ``timeout`` is killed."""
    dist_harness.run(WORLD, _rank, root, tag, arms, timeout=timeout, prepare=_environment,
                     start_method="fork")
    per_rank = [torch.load(os.path.join(root, f"records-{tag}-rank{r}.pt"), weights_only=False)
                for r in range(WORLD)]
    return {arm.name: [records[arm.name] for records in per_rank] for arm in arms}
