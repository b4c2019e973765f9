"""LeaderLoader with a real torch.utils.data.DataLoader between real Gloo ranks: every rank's
batches and default CPU generator equal BASE (every rank running its own loader) to the bit."""

import functools
import json
import os
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

import spbcast
from batches import assert_same
from dist_harness import run
from loader_data import EpochSampler, Samples, StatefulLoader, collate, digest

EPOCHS = 3


def _make(workers, persistent, sampler=False, own_generator=False, main_noise=False):
    """A factory of fresh, identically configured DataLoaders."""
    ds = Samples(noise=not sampler, main_noise=main_noise)

    def make():
        kw = dict(batch_size=2, collate_fn=collate, num_workers=workers,
                  persistent_workers=persistent)
        if own_generator:
            # The base seed and the sampler's seed then come from this generator: BASE draws
            # nothing from the default one, and neither must the followers.
            kw["generator"] = torch.Generator().manual_seed(3)
        if workers:
            # The ranks are spawned processes, whose default context would start workers by
            # spawn too (seconds each, re-importing torch); a trainer under torchrun forks them.
            kw["multiprocessing_context"] = "fork"
        if sampler:
            return DataLoader(ds, sampler=EpochSampler(len(ds)), **kw)
        return DataLoader(ds, shuffle=True, **kw)  # a RandomSampler

    return make


def _model_step(group=None):
    # What a training step draws from the default generator between batches (dropout, ...), and
    # a collective of the trainer's own on the SP group, while the next batch is prefetched.
    torch.rand(5)
    if group is not None:
        total = torch.ones(3)
        dist.all_reduce(total, group=group)
        assert total.tolist() == [dist.get_world_size(group)] * 3


def _base(make, epochs, group=None):
    """BASE: a plain loop over this rank's own loader, as a trainer without spbcast runs it.
    Returns the batches, the generator after each fetch, and the generator after each epoch."""
    loader = make()
    batches, fetched, epoch_ends = [], [], []
    for epoch in range(epochs):
        for batch in loader:
            batches.append(batch)
            fetched.append(torch.get_rng_state())
            _model_step(group)
        epoch_ends.append(torch.get_rng_state())
    return batches, fetched, epoch_ends


def _dedup(make, group, epochs, prefetch=None):
    ll = spbcast.LeaderLoader(make, group, sp_media_dedup=True, total_epoch=epochs)
    # By default the leader prefetches where the fetch runs in worker processes (and it is exact
    # there: the comparison with BASE below), and not where it runs in this process.
    assert ll.stats()["prefetch"] == prefetch, ll.stats()
    steps_per_epoch = 8
    assert len(ll) == epochs * steps_per_epoch and ll.length == steps_per_epoch
    batches, fetched, epoch_ends = [], [], []
    for batch in ll:
        assert ll.epoch == len(batches) // steps_per_epoch and ll.step == len(batches) + 1
        batches.append(batch)
        fetched.append(torch.get_rng_state())
        _model_step(group)
        if ll.step % steps_per_epoch == 0:  # the epoch's last batch: the epoch is over
            epoch_ends.append(torch.get_rng_state())
    assert ll.epoch == epochs and ll.step == epochs * steps_per_epoch
    assert (ll.loader is not None) == ll.is_leader
    return batches, fetched, epoch_ends


def _compare(base, dedup):
    (bb, bf, be), (db, df, de) = base, dedup
    assert len(bb) == len(db), (len(bb), len(db))
    for i in range(len(bb)):
        assert_same(bb[i], db[i], f"step {i + 1}")
        assert torch.equal(bf[i], df[i]), f"step {i + 1}: default CPU generator differs from BASE"
        assert db[i][0]["seq_ctx"].cu_seq_lens_k is db[i][0]["seq_ctx"].cu_seq_lens_q
    assert len(be) == len(de) == EPOCHS
    for e in range(EPOCHS):
        assert torch.equal(be[e], de[e]), f"after epoch {e}: default CPU generator differs from BASE"


def _matrix(rank, world, configs):
    sp_groups = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    group = sp_groups[rank // 2]
    for workers, persistent, *option in configs:
        make = _make(workers, persistent, own_generator=option == ["own generator"],
                     main_noise=option == ["main-process noise"])
        seed = 1234 + rank // 2  # one seed per SP group, as SP ranks must load the same batches
        torch.manual_seed(seed)
        base = _base(make, EPOCHS, group)
        end_base = torch.get_rng_state()
        torch.manual_seed(seed)
        dedup = _dedup(make, group, EPOCHS, prefetch=1 if workers else 0)
        end_dedup = torch.get_rng_state()
        _compare(base, dedup)
        assert torch.equal(end_base, end_dedup), f"{workers} workers: generator at the end"


@pytest.mark.parametrize("configs", [[(0, False), (0, False, "own generator"),
                                      (0, False, "main-process noise")],
                                     [(2, False), (2, True)]],
                         ids=["0 workers: default generator, own generator, augmentation",
                              "2 workers, persistent and not"])
def test_dataloader_equals_base(configs):
    run(2, _matrix, configs, timeout=150)


def test_two_sp_groups_of_two():
    run(4, _matrix, [(2, False)], timeout=150)


# ---- restart at step 20 of 40 ------------------------------------------------------------------

TOTAL = 40


def _continuous(rank, world, out_dir, save_at, epoch_sampler):
    torch.manual_seed(99)
    ll = spbcast.LeaderLoader(_make(2, False, sampler=epoch_sampler), None, sp_media_dedup=True,
                              total_step=TOTAL)
    digests = []
    for batch in ll:
        digests.append(digest(batch))
        _model_step()
        if ll.step == save_at and ll.is_leader:
            with open(os.path.join(out_dir, "state.json"), "w") as f:
                json.dump({"loader": ll.state_dict(), "rng": torch.get_rng_state().tolist()}, f)
    assert len(digests) == TOTAL
    with open(os.path.join(out_dir, f"continuous{rank}.json"), "w") as f:
        json.dump(digests, f)


def _resumed(rank, world, out_dir, save_at, epoch_sampler):
    with open(os.path.join(out_dir, "state.json")) as f:
        saved = json.load(f)
    state = saved["loader"]
    results = {}
    for dedup in (False, True):
        if epoch_sampler:
            torch.manual_seed(7)  # a new process: a seed of its own (the order is the epoch's)
        else:  # as a trainer restores its generator: the later epochs' orders are drawn from it
            torch.set_rng_state(torch.tensor(saved["rng"], dtype=torch.uint8))
        ll = spbcast.LeaderLoader(_make(2, False, sampler=epoch_sampler), None, sp_media_dedup=dedup,
                                  total_step=TOTAL)
        # Dedup: only the leader needs the state; BASE: every rank loads it. A sampler of the
        # program's own is resumed by dropping batches (mid-epoch) or from what it carries (at an
        # epoch's end), warned about on every rank; torch's RandomSampler is replayed from the
        # generators its pass began with, exactly.
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            ll.load_state_dict(state if (ll.is_leader or not dedup) else None)
        resume_warnings = [str(w.message) for w in warned if w.category is spbcast.ResumeWarning]
        mid_epoch = save_at % 8 != 0
        assert len(resume_warnings) == epoch_sampler, resume_warnings
        if resume_warnings:
            expected = ("by dropping the epoch's first 4 batches" if mid_epoch else
                        "resuming at the start of epoch 2: the sampler EpochSampler is not one of torch's")
            assert expected in resume_warnings[0], resume_warnings[0]
        digests, states = [], []
        for batch in ll:
            digests.append(digest(batch))
            states.append(torch.get_rng_state())
            _model_step()
        results[dedup] = (digests, states)
    with open(os.path.join(out_dir, f"continuous{rank}.json")) as f:
        continuous = json.load(f)
    assert results[True][0] == continuous[save_at:], "resumed batches differ from the continuous run"
    assert results[False][0] == continuous[save_at:]
    for i, (a, b) in enumerate(zip(results[False][1], results[True][1])):
        assert torch.equal(a, b), f"resumed step {save_at + i + 1}: generator differs from BASE"


# Step 20 is mid-epoch (8 steps an epoch); step 16 is an epoch's last batch, after which the
# resumed run must start the next epoch. The epoch sampler's order is its epoch's alone; a plain
# DataLoader's RandomSampler draws its order from the default generator as each epoch begins.
@pytest.mark.parametrize("save_at,epoch_sampler", [(20, True), (16, True), (20, False)],
                         ids=["mid-epoch", "epoch end", "mid-epoch, RandomSampler"])
def test_restart_of_40_steps(tmp_path, save_at, epoch_sampler):
    run(2, _continuous, str(tmp_path), save_at, epoch_sampler)
    run(2, _resumed, str(tmp_path), save_at, epoch_sampler)


def _stateful(rank, world):
    # A loader with its own state resumes through it: nothing is fetched twice.
    def run_loader(resume=False, state=None):
        ll = spbcast.LeaderLoader(StatefulLoader, None, sp_media_dedup=True, total_step=15)
        if resume:  # on every SP rank; only the leader's state counts
            ll.load_state_dict(state)
        seen, saved = [], None
        for batch in ll:
            seen.append((batch["epoch"], batch["i"], batch["t"].tolist(), ll.epoch, ll.step))
            if ll.step == 8:
                saved = ll.state_dict()
        return ll, seen, saved

    _, continuous, saved = run_loader()
    assert [s[:2] for s in continuous[5:8]] == [(0, 5), (1, 0), (1, 1)]
    assert (saved == {}) == (rank != 0)
    saved = spbcast.broadcast(saved, src=0)  # the test gives the leader's state to both
    resumed_ll, resumed, _ = run_loader(True, saved if rank == 0 else None)
    assert resumed == continuous[8:]
    if rank == 0:
        assert resumed_ll.loader.fetched == 7


def test_loader_with_its_own_state():
    run(2, _stateful)


# ---- configuration and failures ----------------------------------------------------------------

class Boom:
    def __iter__(self):
        yield [torch.ones(1)]
        raise ValueError("disk on fire")


class BadSample(Exception):
    def __init__(self, index):  # not the message alone: spbcast must not call it
        super().__init__(f"sample {index}")
        self.index = index


class BadSampleLoader:
    def __iter__(self):
        raise BadSample(3)
        yield


def _failures(rank, world):
    # Checked before any collective, the same error on every rank.
    for kwargs, words in [({}, "set exactly one"), ({"total_epoch": 1, "total_step": 1}, "set exactly one"),
                          ({"total_epoch": 1, "tp_size": 2}, "requires TP size 1"),
                          ({"total_epoch": 0}, "positive")]:
        with pytest.raises(spbcast.Error, match=words) as info:
            spbcast.LeaderLoader(list, None, sp_media_dedup=True, **kwargs)
        assert info.value.code == "invalid_argument"

    # A factory that fails on the leader fails on every rank.
    def bad_factory():
        raise OSError("no such dataset")
    with pytest.raises(spbcast.Error, match="no such dataset") as info:
        spbcast.LeaderLoader(bad_factory, None, sp_media_dedup=True, total_epoch=1)
    assert info.value.code == "loader"

    # A loader that throws mid-epoch: every rank raises at that step, after the first batch.
    ll = spbcast.LeaderLoader(Boom, None, sp_media_dedup=True, total_epoch=1)
    it = iter(ll)
    assert torch.equal(next(it)[0], torch.ones(1))
    with pytest.raises(ValueError, match="disk on fire") as info:  # the loader's own type
        next(it)
    assert isinstance(info.value, spbcast.LoaderError) and info.value.code == "loader"
    assert info.value.original_type == "ValueError" and info.value.original_message == "disk on fire"
    assert str(info.value).endswith("failed fetching step 2: ValueError: disk on fire"), str(info.value)
    if rank == 0:  # chained to the loader's exception itself
        assert type(info.value.__cause__) is ValueError and str(info.value.__cause__) == "disk on fire"
    # A class of the program's own: that type on the leader, named on the followers.
    ll = spbcast.LeaderLoader(lambda: BadSampleLoader(), None, sp_media_dedup=True, total_epoch=1)
    with pytest.raises(spbcast.LoaderError) as info:
        next(iter(ll))
    assert isinstance(info.value, BadSample) == (rank == 0), type(info.value).__mro__
    assert info.value.original_type == f"{__name__}.BadSample" and info.value.original_message == "sample 3"

    # A batch spbcast cannot send: refused on every rank with its path inside the envelope.
    ll = spbcast.LeaderLoader(lambda: [[{"ids": {1j}}]], None, sp_media_dedup=True, total_epoch=1)
    with pytest.raises(spbcast.Error, match=r'cannot send step\[1\]\["batch"\]\[0\]\["ids"\]: a set holding a complex') as info:
        next(iter(ll))
    # The same error on every rank, after the step's draws and counters reached it: spbcast's
    # refusal, with a code of its own (a trainer that skips the loader's errors does not skip it).
    assert type(info.value) is spbcast.Error and info.value.code == "unsupported_value" and ll.step == 1
    assert "failed sending step 1: " in str(info.value), str(info.value)

    # A loader that reseeds the default generator cannot be mirrored: refused on every rank.
    def reseeding_loader():
        return (torch.manual_seed(5) and [torch.ones(1)] for _ in range(2))
    ll = spbcast.LeaderLoader(reseeding_loader, None, sp_media_dedup=True, total_epoch=1)
    with pytest.raises(spbcast.Error, match="cannot mirror") as info:
        next(iter(ll))
    assert info.value.code == "loader"
    # SP size 1: dedup has nothing to do; every rank builds its loader and no collective runs.
    singles = [dist.new_group([r]) for r in range(world)]
    ll = spbcast.LeaderLoader(lambda: [[torch.ones(1)]], singles[rank], sp_media_dedup=True,
                              total_epoch=2)
    assert not ll.dedup and ll.loader is not None and len(list(ll)) == 2 and len(ll) == 2
    # A rank outside the group it passes is refused (torch gives it a non-member group).
    with pytest.raises(spbcast.Error, match="not a member") as info:
        spbcast.broadcast(None, group=singles[1 - rank], src=1 - rank)
    assert info.value.code == "invalid_argument"
    # The group is still usable.
    assert spbcast.broadcast("ok" if rank == 0 else None) == "ok"


def test_failures_on_every_rank():
    run(2, _failures)


# ---- a slow leader, and where the leader's batches are allocated --------------------------------

class SlowLoader:
    """Three batches, each with a 2 MiB tensor (large enough for spbcast.shared_memory()).
    Building it takes `build_delay` seconds and fetching the second batch `fetch_delay`."""

    def __init__(self, build_delay=0.0, fetch_delay=0.0, n=3):
        time.sleep(build_delay)
        self.fetch_delay, self.n = fetch_delay, n

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            if i == 1:
                time.sleep(self.fetch_delay)
            yield {"i": i, "t": torch.full((1 << 19,), float(i)), "small": torch.arange(i + 1)}


def _slow_leader(rank, world):
    base = list(SlowLoader())  # BASE: every rank its own loader, no delay
    # The leader is 2.5 s slow building its loader (auto: the followers wait in the same-host
    # handshake) and fetching a batch, with timeout=1: its keep-alive frames hold the
    # followers; without them every follower would raise TransportError (code timeout).
    for transport, build_delay in (("auto", 2.5), ("network", 0.0)):
        make = functools.partial(SlowLoader, build_delay if rank == 0 else 0.0, 2.5)
        t0 = time.monotonic()
        ll = spbcast.LeaderLoader(make, None, sp_media_dedup=True, total_epoch=1, timeout=1.0,
                                  transport=transport)
        got = list(ll)
        assert time.monotonic() - t0 >= 2.5 + build_delay
        assert len(got) == len(base), transport
        for i, (b, g) in enumerate(zip(base, got)):
            assert_same(b, g, f"{transport}: step {i + 1}")
    assert spbcast.broadcast("ok" if rank == 0 else None) == "ok"  # the group is in step


def test_slow_leader_keeps_followers_waiting():
    run(2, _slow_leader)


def _leader_allocation(rank, world):
    expected = list(SlowLoader())
    # (LeaderLoader keywords, whether the leader's batches are born in shared memory). The
    # network transport runs first, so no same-host handshake has been made on the group yet;
    # the second loader's first broadcast makes it (the group takes the same-host path).
    for kwargs, in_shm in (({"transport": "network"}, False),
                           ({"leader_allocates_in_shared_memory": False}, False),
                           ({}, True)):
        before = spbcast.shared_memory_statistics()
        ll = spbcast.LeaderLoader(SlowLoader, None, sp_media_dedup=True, total_epoch=1, **kwargs)
        got = list(ll)
        after = spbcast.shared_memory_statistics()
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{kwargs}: step {i + 1}")
        same_host = spbcast._broadcast._same_host_path(None, 0)
        assert same_host is (None if kwargs.get("transport") == "network" else True), (kwargs, same_host)
        if rank == 0:
            allocated = after["tensors_allocated"] - before["tensors_allocated"]
            shared = after["tensors_shared"] - before["tensors_shared"]
            # One 2 MiB tensor a batch; the small ones stay ordinary memory.
            assert allocated == (len(expected) if in_shm else 0), (kwargs, before, after)
            assert shared == allocated, (kwargs, before, after)
        del got
    # A bad transport is refused on every rank before any collective.
    with pytest.raises(spbcast.Error, match="transport must be") as info:
        spbcast.LeaderLoader(SlowLoader, None, sp_media_dedup=True, total_epoch=1, transport="tcp")
    assert info.value.code == "invalid_argument"


def test_leader_allocates_only_on_the_same_host_path():
    run(2, _leader_allocation)


def _torch_shaped(rank, world):
    import importlib.metadata
    import multiprocessing

    from torch.utils.data import DataLoader

    assert spbcast.__version__ == importlib.metadata.version("spbcast")
    # A loader that drives its own epochs: one iteration is the whole run; iterating it again,
    # or a trainer's set_epoch, is an error that says why (on every rank, no collective).
    ll = spbcast.LeaderLoader(lambda: [[torch.ones(1)]] * 3, None, sp_media_dedup=True, total_epoch=2)
    assert len(ll) == 6 and len(list(ll)) == 6
    with pytest.raises(spbcast.Error, match="has run all its 2 epochs") as info:
        iter(ll)
    assert info.value.code == "invalid_argument"
    with pytest.raises(spbcast.Error, match=r"set_epoch\(5\) on a LeaderLoader that drives the epochs"):
        ll.set_epoch(5)
    # close() and the context manager stop what the loader started: the leader's persistent
    # DataLoader workers.
    make = lambda: DataLoader(list(range(8)), batch_size=2, num_workers=2,  # noqa: E731
                              persistent_workers=True, multiprocessing_context="fork")
    with spbcast.LeaderLoader(make, None, sp_media_dedup=True, total_epoch=1) as ll:
        assert next(iter(ll)).tolist() == [0, 1]
        assert len(multiprocessing.active_children()) == (2 if rank == 0 else 0)
    assert multiprocessing.active_children() == [] and ll.loader is None
    with pytest.raises(spbcast.Error, match="is closed"):
        iter(ll)
    assert spbcast.broadcast("ok" if rank == 0 else None) == "ok"  # the group is in step


def test_torch_shaped_api():
    run(2, _torch_shaped)


class Slow:
    """Three batches of 4 KiB (a view and its base: one storage), 50 ms each to load."""

    def __iter__(self):
        for i in range(3):
            time.sleep(0.05)
            t = torch.full((1024,), float(i))
            yield {"t": t, "view": t[:10]}


def _stats(rank, world):
    for transport, path in (("auto", "same_host"), ("network", "network")):
        lines = []
        ll = spbcast.LeaderLoader(Slow, None, sp_media_dedup=True, total_epoch=1,
                                  transport=transport, log_every=2, log=lines.append)
        assert len(list(ll)) == 3
        s = ll.stats()
        assert (s["path"], s["steps"], s["bytes"], s["prefetch_hits"]) == (path, 3, 3 * 4096, 0), s
        # The leader's loader time: its own on the leader, reported to the followers.
        seen = s["loader_seconds"] if rank == 0 else s["leader_loader_seconds"]
        assert 0.15 <= seen < 5, s
        assert s["broadcast_seconds"] >= (0 if rank == 0 else 0.1), s
        # One line at step 2, one at the end of the data.
        assert len(lines) == 2 and f"3 steps on the {path} path, 0.0 MiB" in lines[1], lines
    ll = spbcast.LeaderLoader(Slow, None, sp_media_dedup=False, total_epoch=1, log_every=0)
    assert len(list(ll)) == 3 and ll.stats()["path"] == "local" and ll.stats()["steps"] == 3
    assert ll.stats()["wait_seconds"] >= 0.15, ll.stats()  # every rank waits for its own loader


def test_stats_say_what_the_broadcasts_did():
    run(2, _stats)
