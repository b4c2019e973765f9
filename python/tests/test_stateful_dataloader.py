"""LeaderLoader over torchdata's StatefulDataLoader (its own state_dict / load_state_dict), at DP 2
x SP 2 on real Gloo groups, with 0 and 2 forked persistent workers, a DistributedSampler over the
DP group and an augmentation drawn from the default generator in __getitem__ (mirrored on the
followers with 0 workers): LeaderLoader driving the epochs and as a drop-in in a trainer's own
epoch loop, against BASE (the bare StatefulDataLoader on every rank): batches bit for bit with
identity, views and storage offsets, and torch.get_rng_state() after every step; resumed in a
new run mid-epoch and right after an epoch's last batch (where StatefulDataLoader's first
iterator after the restore is empty, the end of that epoch) with the continuous run's batches,
and the followers' generators equal a resumed BASE's."""

import gc

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

import spbcast
from batches import assert_same, assert_same_aliasing
from dist_harness import run

stateful_dataloader = pytest.importorskip(
    "torchdata.stateful_dataloader",
    reason="torchdata is not installed (./scripts/setup.sh installs it: pip install torchdata, "
           "constrained to the installed torch)")

EPOCHS, PER_EPOCH = 3, 4  # 16 items, DP 2, batches of 2
MID, END = 6, 8  # mid-epoch 2 (index 1), right after its last batch


class Items(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"ids": torch.randint(0, 1000, (6,), generator=g), "noise": torch.rand(1)}


def collate(items):
    ids = torch.stack([it["ids"] for it in items])
    cu = torch.tensor([0, 6, 12], dtype=torch.int32)
    # XTuner-like aliasing: one tensor twice, and views of one storage at an offset.
    return {"ids": ids[:, :-1], "labels": ids[:, 1:], "cu_q": cu, "cu_k": cu,
            "noise": torch.cat([it["noise"] for it in items])}


def _make(dp_rank, workers):
    sampler = DistributedSampler(Items(), num_replicas=2, rank=dp_rank, shuffle=True, seed=5)
    return stateful_dataloader.StatefulDataLoader(
        Items(), batch_size=2, sampler=sampler, collate_fn=collate, num_workers=workers,
        persistent_workers=workers > 0, multiprocessing_context="fork" if workers else None)


def _same(base, got, what, rng=True, noise=True):
    assert len(got) == len(base), f"{what}: {len(got)} steps, BASE {len(base)}"
    for i, ((bb, br), (gb, gr)) in enumerate(zip(base, got)):
        if not noise:  # a resumed run's generator is not the continuous run's
            bb, gb = dict(bb, noise=None), dict(gb, noise=None)
        pairs = []
        assert_same(bb, gb, f"{what}: step {i + 1}", pairs)
        assert_same_aliasing(pairs)
        for e, g, p in pairs:
            assert g.storage_offset() == e.storage_offset(), f"{p}: storage offset"
        if rng:
            assert torch.equal(br, gr), f"{what}: step {i + 1}: default generator differs from BASE"


def trainer_loop(loader, set_epoch, start_epoch=0, step=0, save_at=()):
    """A trainer's own epoch loop (set_epoch(e) before each epoch after the first, as
    DistributedSampler wants): [(batch, rng)] and the states taken at save_at (with the epoch
    the trainer resumes in)."""
    seen, saved = [], {}
    for epoch in range(start_epoch, EPOCHS):
        if epoch:
            set_epoch(epoch)
        for batch in loader:
            step += 1
            torch.rand(3)  # the model step's own draws
            seen.append((batch, torch.get_rng_state()))
            if step in save_at:
                saved[step] = {"loader": loader.state_dict(), "epoch": epoch}
    return seen, saved


def _stateful(rank, world, workers):
    sp = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    dist.new_group([0, 2]), dist.new_group([1, 3])  # the DP groups, as a trainer makes them
    dp_rank = rank // 2
    make = lambda: _make(dp_rank, workers)  # noqa: E731

    torch.manual_seed(11)
    dl = make()
    base, base_saved = trainer_loop(dl, dl.sampler.set_epoch, save_at=(MID, END))
    del dl
    assert len(base) == EPOCHS * PER_EPOCH

    # LeaderLoader driving the epochs (set_epoch(1), (2) before the later passes).
    torch.manual_seed(11)
    ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, total_epoch=EPOCHS)
    driven, driven_saved = [], {}
    for batch in ll:
        torch.rand(3)
        driven.append((batch, torch.get_rng_state()))
        if ll.step in (MID, END):
            driven_saved[ll.step] = ll.state_dict()
    _same(base, driven, f"workers {workers}: LeaderLoader driving")
    del ll

    # The drop-in in the trainer's own loop.
    torch.manual_seed(11)
    ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, set_epoch=None)
    dropin, dropin_saved = trainer_loop(ll, ll.set_epoch, save_at=(MID, END))
    _same(base, dropin, f"workers {workers}: drop-in")
    assert (dropin_saved[MID]["loader"] == {}) == (rank % 2 == 1)
    del ll
    gc.collect()

    for at in (MID, END):
        # A new run: seeded as at the start, the trainer's epoch set, the loader's state loaded.
        torch.manual_seed(11)
        dl = make()
        epoch = base_saved[at]["epoch"]
        dl.sampler.set_epoch(epoch)
        dl.load_state_dict(base_saved[at]["loader"])
        resumed_base = trainer_loop(dl, dl.sampler.set_epoch, epoch, at)[0]
        _same(base[at:], resumed_base, f"workers {workers}: resumed BASE at {at}", rng=False, noise=False)
        del dl

        torch.manual_seed(11)
        ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, set_epoch=None)
        ll.set_epoch(epoch)
        ll.load_state_dict(dropin_saved[at]["loader"])
        resumed = trainer_loop(ll, ll.set_epoch, epoch, at)[0]
        _same(resumed_base, resumed, f"workers {workers}: resumed drop-in at {at}")
        del ll

        torch.manual_seed(11)
        ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, total_epoch=EPOCHS)
        ll.load_state_dict(driven_saved.get(at, {}))
        resumed = []
        for batch in ll:
            torch.rand(3)
            resumed.append((batch, torch.get_rng_state()))
        _same(base[at:], resumed, f"workers {workers}: resumed LeaderLoader driving at {at}",
              rng=False, noise=False)
        if at == MID:  # an iterator made at the same point as in the resumed BASE: its generator
            _same(resumed_base, resumed, f"workers {workers}: resumed LeaderLoader driving at {at}")
        del ll
        gc.collect()
    dist.barrier()


@pytest.mark.parametrize("workers", [0, 2])
def test_stateful_dataloader(workers):
    run(4, _stateful, workers, timeout=150)
