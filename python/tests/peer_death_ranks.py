"""One rank of test_peer_death.py: a LeaderLoader over a DataLoader (0, 2 or 2 persistent
workers) on a real Gloo group of 3 processes, where one rank ends itself (SIGKILL or SIGSTOP)
at a chosen point. Every other rank records, in its own clock (CLOCK_MONOTONIC, the same for
every process of the host), when spbcast raised and what, into <out>/rank<r>.json; the rank
that ends writes when it sent the signal to <out>/victim.json first.

    python peer_death_ranks.py RANK WORLD OUT_DIR CASE WORKERS
CASE: leader-fetch | leader-broadcast | leader-between | follower-broadcast | follower-between |
      leader-stopped |
      network-leader-between | network-follower-between (with transport="network") |
      hosts-leader-between (as leader-between; the test runs 4 ranks in two network
      namespaces, 2 a "host") |
      trainer-leader (WORLD 4: transformers' real Trainer under spbcast.accelerate.enable on the
      (dp_shard 2, tp 2) mesh of accelerate_ranks.py; the TP leader rank 0 SIGKILLs itself at the
      end of optimizer step 2; the other ranks record what they raised, spbcast's or the
      backend's: ranks 2 and 3 fail in the gradients' all-reduce, not in spbcast)
WORKERS: 0 | 2 | 2p (persistent)

The drop-ins' kill tests (energon_ranks.py, swift_ranks.py, xtuner_trainer.py) end their victim
and record their survivors with this module's ``end_myself`` and ``survive`` (and slow their
leader's fetch with ``slow_down``).
"""

import datetime
import json
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import spbcast

STOP_STEP = 3          # the step at which the victim ends itself
ROOT_WAIT = 3.0        # the followers' wait for a leader that starts no step (SIGSTOP case)


class Items(Dataset):
    """Slow items (the leader's fetch takes a while); large ones for the broadcast case."""

    def __init__(self, big, delay):
        self.big, self.delay = big, delay

    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(self.delay)
        n = (8 << 20) if self.big else 16
        return {"x": torch.full((n,), float(i)), "i": i}


def _write(path, record):
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


def end_myself(out, sig, when=0.0):
    """Records the moment and sends ``sig`` to this process (after ``when`` seconds, from a
    thread, so the process is caught in whatever it does then)."""
    def go():
        if when:
            time.sleep(when)
        _write(os.path.join(out, "victim.json"), {"signal": int(sig), "at": time.monotonic(), "pid": os.getpid()})
        os.kill(os.getpid(), sig)
    if when:
        threading.Thread(target=go, daemon=True).start()
    else:
        go()


def trainer(rank, world, out, workers):
    """The trainer-leader case: the drop-in inside its real loop."""
    import accelerate_ranks as ar  # imports spbcast.accelerate
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Trainer, TrainerCallback, TrainingArguments

    ar._environment(rank)
    join_group(rank, world, out)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0 and state.global_step == 2:
                end_myself(out, signal.SIGKILL)

    args = TrainingArguments(output_dir=os.path.join(out, f"trainer{rank}"), per_device_train_batch_size=2,
                             gradient_accumulation_steps=2, num_train_epochs=2, save_strategy="no",
                             logging_strategy="no", use_cpu=True, seed=ar.SEED, report_to=[],
                             dataloader_num_workers=int(workers), disable_tqdm=True)
    t = Trainer(model=ar.tiny_llama(), args=args, train_dataset=ar.Samples(ar.TRAINER_SAMPLES), callbacks=[Kill()])
    t.accelerator.state.device_mesh = mesh
    spbcast.accelerate.enable(t.accelerator)
    # Ranks 2 and 3 fail in the backend, not in spbcast.
    survive(out, rank, t.train, dist.destroy_process_group)


def main():
    rank, world, out, case, workers = sys.argv[1:6]
    rank, world = int(rank), int(world)
    os.environ["RANK"] = str(rank)
    if case == "trainer-leader":
        return trainer(rank, world, out, workers)
    torch.set_num_threads(1)
    join_group(rank, world, out)
    num_workers = 0 if workers == "0" else 2
    big = case.endswith("-broadcast")
    delay = 0.4 if case == "leader-fetch" else 0.01

    def make():
        return DataLoader(Items(big, delay), batch_size=2, num_workers=num_workers,
                          persistent_workers=workers == "2p")

    transport = "network" if case.startswith("network-") else "auto"
    case = case.removeprefix("network-")
    victim = 1 if case.startswith("follower") else 0
    root_wait = ROOT_WAIT if case == "leader-stopped" else None
    ll = spbcast.LeaderLoader(make, None, sp_media_dedup=True, total_epoch=4, timeout=2,
                              root_wait=root_wait, prefetch=1, transport=transport)

    def loop():
        for step, batch in enumerate(ll):
            if rank == victim and step == STOP_STEP:
                if case == "leader-fetch":
                    end_myself(out, signal.SIGKILL, when=0.2)  # the next fetch takes 0.8 s
                elif case.endswith("-broadcast"):
                    end_myself(out, signal.SIGKILL, when=0.05)  # 16 MiB batches in flight
                elif case == "leader-stopped":
                    end_myself(out, signal.SIGSTOP)
                else:
                    end_myself(out, signal.SIGKILL)
            time.sleep(0.02)  # the trainer's step

    def close():
        ll.close()
        dist.destroy_process_group()

    survive(out, rank, loop, close)


def slow_down(cls, name, seconds):
    """Makes every call of ``cls.name`` take ``seconds`` longer, in this process and the DataLoader
    workers it forks later: a leader whose fetch is slower than a step, so that its follower waits
    for the batch in the loader when the leader dies."""
    method = getattr(cls, name)

    def slower(obj, *args, **kwargs):
        time.sleep(seconds)
        return method(obj, *args, **kwargs)

    setattr(cls, name, slower)


def join_group(rank, world, out):
    """The default process group of a job whose ranks meet in ``out`` (a file store)."""
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))


def survive(out, rank, body, close):
    """Runs a surviving rank's loop ``body`` and records what it raised and when into
    <out>/rank<r>.json - after ``close`` (what a trainer does after the error: close the loader,
    destroy the process group, which joins the backend's threads, so a thread still waiting on
    the dead peer would show here) - then leaves (os._exit: the interpreter's own teardown of
    torch is no part of this)."""
    record = {"rank": rank, "pid": os.getpid(), "error": None}
    try:
        body()
    except Exception as e:  # noqa: BLE001 - the test judges what it was (spbcast's, or the backend's)
        record.update(error=str(e), type=type(e).__name__, code=getattr(e, "code", None), at=time.monotonic())
    close()
    record["children"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit() and proc_stat(p, 1) == os.getpid())
    _write(os.path.join(out, f"rank{rank}.json"), record)
    os._exit(0)


def proc_stat(pid, field):
    """Field ``field`` of /proc/<pid>/stat after the command's name (1: the parent, 3: the
    session), as an int; -1 for a process that is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[field])
    except (OSError, IndexError, ValueError):
        return -1


if __name__ == "__main__":
    main()
