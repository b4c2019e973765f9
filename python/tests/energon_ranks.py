"""Megatron-Energon's real loader on 4 Gloo ranks (DP 2 x TP 2), for test_energon.py.

``write_dataset`` makes a captioning WebDataset (several tar shards of small PNG images and
captions) and prepares it with Energon's own ``energon prepare``, non-interactively. ``run_arms``
runs on each rank (dist_harness.run): for each arm in turn it builds Energon's train dataset with
``WorkerConfig(rank=dp_rank, world_size=2, num_workers=..., data_parallel_group=...)`` and a
loader - Energon's own (BASE) or ``spbcast.energon.get_savable_loader(..., group=tp_group)``
(dedup) - iterates it, and records per step the batch and ``torch.get_rng_state()``, the loader's
states after step SAVE_AT, how many samples this rank's task encoder encoded, or the exception a
rank raised. ``launch`` forks the ranks of one job from the test's process, which imported torch
and Energon once (spawned ranks would import them again, seconds each on 2 cores), and returns
their records. ``leader_dies`` is one rank of test_energon.py's kill test.
"""

import dataclasses
import gc
import io
import os
import signal
import tarfile
import time

import numpy as np
import torch
import torch.distributed as dist
from megatron.energon import (DefaultTaskEncoder, WorkerConfig, get_savable_loader,
                              get_train_dataset, stateless)
from megatron.energon.tools.prepare import command as energon_prepare
from PIL import Image

import dist_harness
import peer_death_ranks
import spbcast.energon

DP, TP = 2, 2
WORLD = DP * TP
LEADERS, FOLLOWERS = (0, 2), (1, 3)  # the TP groups are {0, 1} and {2, 3}
BATCH = 2
STEPS, SAVE_AT = 6, 3
SHARDS, SAMPLES_PER_SHARD = 4, 12


def write_dataset(root):
    """Tar shards of (16 x 16 PNG, caption) samples, prepared by ``energon prepare`` as a user
    runs it (its whole split "train"), with Energon's CaptioningSample and a field map."""
    rng = np.random.default_rng(0)
    for shard in range(SHARDS):
        with tarfile.open(os.path.join(root, f"shard-{shard}.tar"), "w") as tar:
            for i in range(SAMPLES_PER_SHARD):
                key = f"s{shard}_{i:03d}"
                image = io.BytesIO()
                Image.fromarray(rng.integers(0, 256, (16, 16, 3), dtype=np.uint8)).save(image, format="PNG")
                for ext, data in (("png", image.getvalue()), ("txt", f"a caption of {key}".encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    energon_prepare.main([root, "--non-interactive", "--split-ratio", "1,0,0", "--num-workers", "1",
                          "--sample-type", "CaptioningSample",
                          "--field-map", '{"image": "png", "caption": "txt"}'], standalone_mode=False)


class CountingTaskEncoder(DefaultTaskEncoder):
    """Energon's default captioning pipeline, plus: each encoded sample appends one byte to
    ``count_path`` (from whichever process encodes it: a worker, or the rank itself with 0
    workers), and a random horizontal flip drawn from the encoding process's torch generator
    (Energon seeds its workers from the WorkerConfig)."""

    def __init__(self, count_path):
        super().__init__()
        self.count_path = count_path

    @stateless(restore_seeds=True)
    def encode_sample(self, sample):
        with open(self.count_path, "a") as f:
            f.write("x")
        if torch.rand(()) < 0.5:
            sample.image = sample.image.flip(-1)
        return sample


@dataclasses.dataclass
class UnknownBatch:
    """A user's batch class that no rank allowed: spbcast must refuse it."""
    image: torch.Tensor
    caption: list


class UnknownClassEncoder(CountingTaskEncoder):
    def encode_batch(self, batch):
        return UnknownBatch(image=batch.image, caption=batch.caption)


class HostileClassEncoder(CountingTaskEncoder):
    """A batch carrying one of Energon's classes that is no sample or batch class (its
    WorkerConfig): allowing Energon's batch classes must not allow it."""

    def encode_batch(self, batch):
        return {"image": batch.image, "config": WorkerConfig(rank=0, world_size=1, num_workers=0)}


ENCODERS = {"count": CountingTaskEncoder, "unknown": UnknownClassEncoder, "hostile": HostileClassEncoder}


@dataclasses.dataclass
class Arm:
    """One run of the loader on every rank. resume: (the arm whose state at SAVE_AT to restore,
    "rank", "dprank" or "global"); followers_build: whether dedup followers build the dataset (else they
    pass None); wrong_group: dedup given the DP group instead of the TP group."""
    name: str
    dedup: bool
    workers: int = 2
    resume: tuple | None = None
    followers_build: bool = True
    encoder: str = "count"
    batch_size: int = BATCH
    wrong_group: bool = False


def _groups(rank):
    tp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return tp_groups[rank // TP], dp_groups[rank % TP]


def _loader(arm, root, rank, tp_group, dp_group):
    dp_rank = rank // TP
    dataset = None
    if not arm.dedup or arm.followers_build or rank in LEADERS:
        config = WorkerConfig(rank=dp_rank, world_size=DP, num_workers=arm.workers,
                              data_parallel_group=dp_group)
        encoder = ENCODERS[arm.encoder](os.path.join(root, f"encoded-{arm.name}-rank{rank}"))
        dataset = get_train_dataset(os.path.join(root, "data"), worker_config=config,
                                    batch_size=arm.batch_size, shuffle_buffer_size=8,
                                    max_samples_per_sequence=4, task_encoder=encoder)
    # An internal checkpoint at every sample (not every 60 s): the saved state depends on the
    # position only, so BASE's and dedup's can be compared.
    energon_kwargs = dict(checkpoint_every_sec=0, checkpoint_every_min_n_samples=1)
    if not arm.dedup:
        return get_savable_loader(dataset, **energon_kwargs)
    group = dp_group if arm.wrong_group else tp_group
    return spbcast.energon.get_savable_loader(dataset, group=group, **energon_kwargs)


def _restore(loader, arm, root, rank):
    source, kind = arm.resume
    if kind in ("rank", "dprank"):
        # "rank": what this rank saved (None on a dedup follower). "dprank": what its DP rank's
        # first rank saved, as Megatron-Bridge saves train_dataloader_dprank*.pt from
        # tp = cp = pp = 0 only and every rank of that DP rank loads it.
        saver = rank if kind == "rank" else rank // TP * TP
        loader.restore_state_rank(torch.load(os.path.join(root, f"state-{source}-rank{saver}.pt"),
                                             weights_only=False))
    else:  # the list gathered to rank 0 over its DP group, scattered from DP rank 0
        state = None
        if rank == 0:
            state = torch.load(os.path.join(root, f"state-{source}-global.pt"), weights_only=False)
        loader.restore_state_global(state, src_rank=0)


def _run_arm(arm, root, rank, tp_group, dp_group):
    record = {"steps": [], "rng": [], "error": None}
    torch.manual_seed(100 + rank)  # a seed per rank: a follower must advance its own generator
    loader = None
    try:
        loader = _loader(arm, root, rank, tp_group, dp_group)
        if arm.resume is not None:
            _restore(loader, arm, root, rank)
        record["len"] = len(loader)
        record["rng_start"] = torch.get_rng_state()
        steps = STEPS - SAVE_AT if arm.resume is not None else STEPS
        batches = iter(loader)
        for step in range(1, steps + 1):
            record["steps"].append(next(batches))
            record["rng"].append(torch.get_rng_state())
            if step == SAVE_AT and arm.resume is None:
                state = loader.save_state_rank()
                record["state"] = state
                torch.save(state, os.path.join(root, f"state-{arm.name}-rank{rank}.pt"))
                # Every rank to the first rank of its DP group, as in BASE.
                dst = dist.get_global_rank(dp_group, 0)
                gathered = loader.save_state_global(dst)
                record["global_state"] = gathered
                if rank == 0:
                    torch.save(gathered, os.path.join(root, f"state-{arm.name}-global.pt"))
                # A new iter() mid-pass, as a trainer's wrapper may call: Energon's continues.
                batches = iter(loader)
        stats = getattr(loader, "stats", None)
        record["prefetch"] = stats()["prefetch"] if callable(stats) else None
    except Exception as e:  # noqa: BLE001 - recorded for the test to check on every rank
        record["error"] = {"mro": [c.__name__ for c in type(e).__mro__], "message": str(e),
                           "code": getattr(e, "code", None)}
    finally:
        close = getattr(loader, "close", None)
        if callable(close):
            close()
        else:  # Energon's own: its persistent workers end with its iterator
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None:
                iterator._shutdown_workers()
        del loader
        gc.collect()
    path = os.path.join(root, f"encoded-{arm.name}-rank{rank}")
    record["encoded"] = os.path.getsize(path) if os.path.exists(path) else 0
    return record


def run_arms(rank, world, root, tag, arms):
    """One rank of a job: every arm in turn; the records to a file."""
    torch.set_num_threads(1)
    tp_group, dp_group = _groups(rank)
    records = {}
    for arm in arms:
        records[arm.name] = _run_arm(arm, root, rank, tp_group, dp_group)
        dist.barrier()
    torch.save(records, os.path.join(root, f"result-{tag}-rank{rank}.pt"))


def launch(root, tag, arms, timeout=120):
    """Runs ``arms`` on WORLD ranks forked from this process; returns each rank's records."""
    dist_harness.run(WORLD, run_arms, root, tag, arms, timeout=timeout, start_method="fork")
    return [torch.load(os.path.join(root, f"result-{tag}-rank{r}.pt"), weights_only=False)
            for r in range(WORLD)]


def leader_dies(root, workers, rank, out):
    """One rank of a job whose TP leader rank 0 SIGKILLs itself between steps, in Energon's loop
    under dedup with ``workers`` Energon workers (forked by peer_death.fork): each survivor
    records what it raised (peer_death_ranks.survive) - its follower rank 1 spbcast's error
    naming it; the other TP pair runs its steps to the end."""
    os.environ["RANK"] = str(rank)  # the launcher's global rank, which the error names
    torch.set_num_threads(1)
    peer_death_ranks.join_group(rank, WORLD, out)
    tp_group, dp_group = _groups(rank)
    loader = _loader(Arm(f"dies-{workers}", True, workers=workers), root, rank, tp_group, dp_group)

    def loop():
        for step, _ in zip(range(8), loader):
            if rank == 0 and step == 3:
                peer_death_ranks.end_myself(out, signal.SIGKILL)
            time.sleep(0.02)  # the trainer's step

    def close():
        loader.close()
        dist.destroy_process_group()

    peer_death_ranks.survive(out, rank, loop, close)
