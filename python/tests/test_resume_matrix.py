"""Resume, generated: every DataLoader setting a trainer uses x every save point, each resumed
into a fresh LeaderLoader with the trainer's generator restored, against the continuous run -
the same samples in the same order and the same default generator after every step, or a
ResumeWarning on every SP rank; never silently different.

The settings: 0 workers, 2 workers, 2 persistent workers; torch's RandomSampler on the default
generator and with a generator of its own, DistributedSampler (set_epoch), a BatchSampler with
drop_last, and a sampler of the program's own (warned about: what it carries is not restored); the epochs driven by the loader (total_epoch) or by the trainer (set_epoch=None and
its own set_epoch calls); prefetch off and on (where the workers make it exact). The save
points: before the first step, mid first pass, after the first pass's last batch, mid second
pass (the resumed run goes on through the third). Each sample carries a torch.rand drawn where the
dataset runs (a worker, or this process with 0 workers): worker-side randomness. A few of the
cases also resume in new processes (test_loader.py's restart, and the plain trainer below)."""

import itertools
import os
import random
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler

import spbcast
from dist_harness import run

SAMPLES, BATCH, PASSES = 8, 2, 3
DP_SIZE, DP_RANK = 2, 0  # DistributedSampler's share: half the samples, as on DP rank 0


class Augmented(torch.utils.data.Dataset):
    """A sample: its index and a draw of the generator where the dataset runs."""

    def __init__(self, samples=SAMPLES):
        self.samples = samples

    def __len__(self):
        return self.samples

    def __getitem__(self, i):
        return {"idx": torch.tensor(i), "noise": torch.rand(1)}


class CarriedSampler(torch.utils.data.Sampler):
    """A sampler of the program's own: its order comes from a Python generator that carries over
    from one pass to the next, which no checkpoint of spbcast's holds."""

    def __init__(self, n):
        self.n, self.rng = n, random.Random(5)

    def __len__(self):
        return self.n

    def __iter__(self):
        return iter(self.rng.sample(range(self.n), self.n))


def _make_loader(workers, sampler):
    dataset = Augmented()
    # Workers forked, as a trainer on Linux has them (the ranks here are spawned processes,
    # whose default start method would spawn each worker: a torch import apiece).
    options = {"num_workers": 0 if workers == "0" else 2,
               "persistent_workers": workers == "2 persistent",
               "multiprocessing_context": None if workers == "0" else "fork"}
    if sampler == "random":
        return DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset), **options)
    if sampler == "random, own generator":
        generator = torch.Generator().manual_seed(7)
        return DataLoader(dataset, batch_size=BATCH, sampler=RandomSampler(dataset, generator=generator),
                          **options)
    if sampler == "distributed":
        return DataLoader(dataset, batch_size=BATCH, **options,
                          sampler=DistributedSampler(dataset, DP_SIZE, DP_RANK, shuffle=True, seed=3))
    if sampler == "the program's own":
        return DataLoader(dataset, batch_size=BATCH, sampler=CarriedSampler(len(dataset)), **options)
    assert sampler == "batch sampler, drop_last"
    return DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), 3, drop_last=True),
                      **options)


WORKERS = ("0", "2", "2 persistent")
SAMPLERS = ("random", "random, own generator", "distributed", "batch sampler, drop_last", "the program's own")
DRIVERS = ("loader", "trainer")
CASES = [(w, s, d, p) for w, s, d in itertools.product(WORKERS, SAMPLERS, DRIVERS)
         for p in ((0,) if w == "0" else (0, None))]


def _leader_loader(sp, workers, sampler, driver, prefetch):
    kwargs = {"total_epoch": PASSES} if driver == "loader" else {"set_epoch": None}
    return spbcast.LeaderLoader(lambda: _make_loader(workers, sampler), sp, sp_media_dedup=True,
                                prefetch=prefetch, log_every=0, **kwargs)


def _steps(loader, driver, first_pass=0):
    """The trainer's loop: (pass, batch) per step; with the trainer driving, set_epoch before
    each pass (a no-op for samplers without one, as on a DataLoader)."""
    if driver == "loader":
        for batch in loader:
            yield loader.epoch, batch
        return
    for epoch in range(first_pass, PASSES):
        loader.set_epoch(epoch)
        for batch in loader:
            yield epoch, batch


def _record(batch):
    torch.rand(2)  # the model step's own draws
    return batch["idx"].tolist(), batch["noise"].flatten().tolist(), torch.get_rng_state()


def _continuous(sp, case, save_at):
    loader = _leader_loader(sp, *case)
    records, saved = [], {}
    if 0 in save_at:
        saved[0] = (loader.state_dict(), torch.get_rng_state(), 0)
    for step, (epoch, batch) in enumerate(_steps(loader, case[2]), 1):
        records.append(_record(batch))
        if step in save_at:
            # Saved after the step, as a trainer does: the loader's state, the trainer's
            # generator, and (driving the epochs itself) the pass to go on from.
            saved[step] = (loader.state_dict(), torch.get_rng_state(), epoch)
    loader.close()
    return records, saved


def _resumed(sp, case, saved):
    state, rng, epoch = saved
    loader = _leader_loader(sp, *case)
    torch.set_rng_state(rng)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loader.load_state_dict(state)
    warned = [str(w.message) for w in caught if w.category is spbcast.ResumeWarning]
    records = [_record(batch) for _, batch in _steps(loader, case[2], first_pass=epoch)]
    loader.close()
    return records, warned


def _matrix(rank, world, cases, results_dir):
    sp = dist.new_group(list(range(world)))
    torch.manual_seed(0)
    outcomes = []
    for case in cases:
        length = len(_make_loader(case[0], case[1]))
        save_at = (0, 1, length, length + 1)
        torch.manual_seed(1)
        records, saved = _continuous(sp, case, save_at)
        assert len(records) == PASSES * length, (case, len(records))
        for step in save_at:
            resumed, warned = _resumed(sp, case, saved[step])
            expected = records[step:]
            where = f"{case} saved after step {step}"
            assert len(resumed) == len(expected), f"{where}: {len(resumed)} steps, not {len(expected)}"
            order = [r[0] for r in resumed] == [e[0] for e in expected]
            noise = [r[1] for r in resumed] == [e[1] for e in expected]
            rng = all(torch.equal(r[2], e[2]) for r, e in zip(resumed, expected))
            own_sampler = case[1] == "the program's own"
            # Never silently different; with torch's samplers, the order and the generator always
            # the continuous run's (what persistent workers draw may differ, warned about).
            assert order or warned and own_sampler, f"{where}: resumed onto another order {[r[0] for r in resumed]} != {[e[0] for e in expected]}"
            assert rng or warned and own_sampler, f"{where}: the default generator is not the continuous run's"
            assert noise or warned, f"{where}: worker-side randomness differs, and no ResumeWarning"
            outcomes.append((case, step, bool(warned), noise))
    torch.save(outcomes, os.path.join(results_dir, f"rank{rank}.pt"))


def test_every_setting_resumes_exactly_or_warns(tmp_path):
    run(2, _matrix, CASES, str(tmp_path), timeout=600)
    leader, follower = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    # The same decision on every SP rank: warned on both or on neither.
    assert [o[:3] for o in leader] == [o[:3] for o in follower]
    for case, step, warned, _ in leader:
        # Warned where the continuous run's persistent workers had run an earlier pass, or the
        # program's own sampler had drawn; nowhere else.
        # (With the trainer driving, a save after the first pass's last batch is still in that
        # pass, which the first iter() resumed replays exactly.)
        length = len(_make_loader(*case[:2]))
        persistent_later = case[0] == "2 persistent" and (step > length or step == length and case[2] == "loader")
        own_sampler_drew = case[1] == "the program's own" and step > 0
        assert warned == (persistent_later or own_sampler_drew), (case, step, warned)


# ---- the plain trainer, resumed in new processes ------------------------------------------------

PLAIN_SAMPLES, PLAIN_SAVE_AT = 12, 8  # 6 steps an epoch: step 8 is mid-epoch 2


def _plain_trainer(rank, world, out_dir, resume):
    # docs/python.md's plain trainer: DP2 x SP2, a DataLoader with 2 persistent workers over a
    # RandomSampler, 3 epochs, a checkpoint after step 8 holding each rank's state_dict() and
    # generator; the resumed run restores the generator, then load_state_dict on every rank.
    sp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    torch.manual_seed(0)

    def make():
        dataset = Augmented(PLAIN_SAMPLES)
        return DataLoader(dataset, batch_size=2, sampler=RandomSampler(dataset), num_workers=2,
                          persistent_workers=True, multiprocessing_context="fork")

    loader = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, total_epoch=3)
    path = os.path.join(out_dir, f"rank{rank}.pt")
    warned = []
    if resume:
        saved = torch.load(path)
        torch.set_rng_state(saved["rng"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loader.load_state_dict(saved["loader"])
        warned = [str(w.message) for w in caught if w.category is spbcast.ResumeWarning]
    records = []
    for batch in loader:
        records.append(_record(batch))
        if not resume and loader.step == PLAIN_SAVE_AT:
            torch.save({"loader": loader.state_dict(), "rng": torch.get_rng_state()}, path)
    loader.close()
    torch.save({"records": records, "warned": warned}, os.path.join(out_dir, f"run{rank}-{resume}.pt"))


def test_plain_trainer_with_persistent_workers_resumes_in_new_processes(tmp_path):
    run(4, _plain_trainer, str(tmp_path), False)
    run(4, _plain_trainer, str(tmp_path), True)
    for rank in range(4):
        continuous, resumed = (torch.load(tmp_path / f"run{rank}-{r}.pt") for r in (False, True))
        expected = continuous["records"][PLAIN_SAVE_AT:]
        got = resumed["records"]
        assert len(continuous["records"]) == 18 and len(got) == len(expected)
        assert [g[0] for g in got] == [e[0] for e in expected], f"rank {rank}: another sample order"
        assert all(torch.equal(g[2], e[2]) for g, e in zip(got, expected)), f"rank {rank}: generator"
        # The workers ran epoch 1 before the checkpoint: what they draw cannot be restored.
        assert len(resumed["warned"]) == 1 and "persistent_workers=True" in resumed["warned"][0], resumed
