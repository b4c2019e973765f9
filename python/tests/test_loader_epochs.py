"""LeaderLoader in a host trainer's epoch numbering (XTuner's: epochs counted from 1, set_epoch(2),
(3), ... called by the trainer after each pass), with the loader's own checkpoint API under
its own names or hooks, a state call that is a collective over the DP group, and datasets
built on every rank: every rank's batches and default CPU generator equal BASE (the loader
without LeaderLoader)."""

import pytest
import torch
import torch.distributed as dist

import spbcast
from dist_harness import run
from loader_data import HookedLoader, XTunerLikeLoader, xtuner_steps

TOTAL = 15  # 3 epochs of 5 batches
SAVE_AT = 7  # mid-epoch 2


def _record(data):
    return (data["epoch"], data["salt"], data["idx"].tolist(), torch.get_rng_state())


def xtuner_loop(loader, total_step, cur_epoch=1, cur_step=0, save_at=None):
    """XTuner's Trainer._data_iter and the step around it: the trainer counts epochs from 1 and
    calls set_epoch(2), (3), ... after each pass; at save_at it takes the loader's state
    (get_state_dict, on every rank) with its own position and generator."""
    seen, saved = [], None
    for step, epoch, data in xtuner_steps(loader, total_step, cur_epoch, cur_step):
        seen.append(_record(data))
        torch.rand(3)  # the model step's own draws
        if step == save_at:
            saved = {"loader": loader.get_state_dict(), "epoch": epoch, "step": step,
                     "rng": torch.get_rng_state()}
    return seen, saved


def _same(base, got, what, rng=True):
    """The same batches and, with rng, the same generator after each; without rng, the same
    data order (epoch, indices), not the draws of set_epoch, which depend on the generator."""
    assert len(base) == len(got), (what, len(base), len(got))
    for i, (b, g) in enumerate(zip(base, got)):
        if rng:
            assert b[:3] == g[:3], f"{what}: step {i + 1}: batch {g[:3]} != BASE {b[:3]}"
            assert torch.equal(b[3], g[3]), f"{what}: step {i + 1}: default generator differs from BASE"
        else:
            assert (b[0], b[2]) == (g[0], g[2]), f"{what}: step {i + 1}: batch {g[:3]} != BASE {b[:3]}"


def _resumed(loader, state, loop=xtuner_loop):
    # As a new process resumes: the trainer restores its generator and position, and gives the
    # loader the state it saved (a follower's LeaderLoader state is {} and ignored).
    torch.set_rng_state(state["rng"])
    loader.load_state_dict(state["loader"])
    return loop(loader, TOTAL, cur_epoch=state["epoch"], cur_step=state["step"])[0]


def _xtuner(rank, world):
    # Two SP groups of two; the DP groups join the ranks of one SP rank, so the leaders' DP
    # group is [0, 2]: the only ranks that may call the loader's collective get_state_dict.
    sp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    sp, dp = sp_groups[rank // 2], dp_groups[rank % 2]
    seed = rank // 2  # one data order per DP replica, the same within an SP group

    def make():
        return XTunerLikeLoader(seed, dp)

    torch.manual_seed(100 + seed)
    base, base_saved = xtuner_loop(make(), TOTAL, save_at=SAVE_AT)
    # The trainer's first pass uses the loader's own epoch, then set_epoch(2) and (3).
    assert [b[0] for b in base] == [0] * 5 + [2] * 5 + [3] * 5

    # The drop-in: the trainer drives the epochs (set_epoch=None), each iter() is one pass.
    torch.manual_seed(100 + seed)
    ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, first_epoch=1, set_epoch=None)
    assert len(ll) == 5 and ll.epoch == 1
    dropin, saved = xtuner_loop(ll, TOTAL, save_at=SAVE_AT)
    _same(base, dropin, "drop-in")
    assert ll.epoch == 3 and ll.step == TOTAL
    if ll.is_leader:
        assert ll.loader.set_epochs == [2, 3]
        # The leaders of both DP replicas took the collective state together.
        assert saved["loader"]["loader"]["total_consumed"] == base_saved["loader"]["total_consumed"] == 28
    else:
        assert ll.loader is None and saved["loader"] == {}

    # LeaderLoader driving the passes itself in the same numbering: set_epoch(2), (3) with no
    # trainer calls; state_dict() taken mid-run on every rank (the leaders' collective again).
    torch.manual_seed(100 + seed)
    ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, first_epoch=1, total_step=TOTAL)
    driven, driven_saved = [], None
    for data in ll:
        driven.append(_record(data))
        torch.rand(3)
        if ll.step == SAVE_AT:
            driven_saved = {"loader": ll.state_dict(), "rng": torch.get_rng_state()}
    _same(base, driven, "LeaderLoader driving the epochs")
    assert ll.epoch == 3
    assert (ll.loader.set_epochs == [2, 3]) if ll.is_leader else ll.loader is None

    # Resumed at step 7 (mid-epoch) as a new process: the continuous run's batches, and the
    # followers' generators those of a resumed BASE.
    resumed_base = _resumed(make(), base_saved)
    _same(base[SAVE_AT:], resumed_base, "resumed BASE", rng=False)
    ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, first_epoch=1, set_epoch=None)
    _same(resumed_base, _resumed(ll, saved), "resumed drop-in")
    torch.set_rng_state(driven_saved["rng"])
    ll = spbcast.LeaderLoader(make, sp, sp_media_dedup=True, first_epoch=1, total_step=TOTAL)
    ll.load_state_dict(driven_saved["loader"])
    _same(base[SAVE_AT:], [_record(d) for d in ll], "resumed LeaderLoader driving the epochs", rng=False)


def test_xtuner_epochs_and_resume():
    run(4, _xtuner, timeout=150)


class BadEpoch(list):
    def set_epoch(self, epoch):
        raise ValueError("no such epoch")


def _every_rank(rank, world):
    calls = {"build": 0, "make": 0}

    def build():
        # A dataset whose construction is collective (every rank takes part) and draws from
        # the default generator on every rank, as in BASE.
        calls["build"] += 1
        t = torch.ones(1)
        dist.all_reduce(t)
        assert t.item() == world
        torch.rand(2)
        return list(range(8))

    def make(dataset):
        calls["make"] += 1
        return HookedLoader(dataset, seed=3)

    epoch_for_pass = lambda i: 10 + i  # noqa: E731 - set_epoch(10), (11), (12), the first too
    torch.manual_seed(5)
    loader = make(build())
    base = []
    for i in range(3):
        loader.set_epoch(10 + i)
        for data in loader:
            base.append(_record(data))
            torch.rand(3)

    torch.manual_seed(5)
    kwargs = dict(sp_media_dedup=True, build_on_every_rank=build, set_epoch=epoch_for_pass,
                  total_epoch=3, state_hooks=(lambda l: l.snapshot(), lambda l, s: l.restore(s)))
    ll = spbcast.LeaderLoader(make, None, **kwargs)
    got, state = [], None
    for data in ll:
        got.append(_record(data))
        torch.rand(3)
        if ll.step == 6:
            state = ll.state_dict()
    _same(base, got, "build_on_every_rank, set_epoch callable")
    assert calls == {"build": 2, "make": 2 if rank == 0 else 1}
    if rank == 0:
        assert ll.loader.set_epochs == [10, 11, 12] and state["loader"] == {"epoch": 11, "salt": base[5][1], "pos": 2}
    # Resumed through the hooks, on the leader only.
    ll = spbcast.LeaderLoader(make, None, **kwargs)
    ll.load_state_dict(state if rank == 0 else None)
    _same(base[6:], [_record(d) for d in ll], "resumed through the hooks", rng=False)

    # A set_epoch the trainer asks for runs on the leader at its next fetch: a failure there
    # reaches every rank, at that step.
    ll = spbcast.LeaderLoader(lambda: BadEpoch([[torch.ones(1)]] * 2), None, sp_media_dedup=True,
                              set_epoch=None)
    assert len(list(ll)) == 2 and len(list(ll)) == 2  # one pass per iter()
    ll.set_epoch(4)
    assert ll.epoch == 4
    with pytest.raises(spbcast.Error, match=r"set_epoch\(4\) raised ValueError: no such epoch") as info:
        next(iter(ll))
    assert info.value.code == "loader"
    assert spbcast.broadcast("ok" if rank == 0 else None) == "ok"


def test_build_on_every_rank_and_state_hooks():
    run(2, _every_rank)


def test_epoch_numbering_and_configuration():
    # No dedup, no process group: the loader's set_epoch calls in each numbering.
    def passes(**kwargs):
        ll = spbcast.LeaderLoader(lambda: XTunerLikeLoader(0), None, sp_media_dedup=False,
                                  total_epoch=3, **kwargs)
        assert len(list(ll)) == 15
        return ll.loader.set_epochs, ll.epoch

    assert passes() == ([1, 2], 3)  # the default: epochs from 0
    assert passes(first_epoch=1) == ([2, 3], 4)  # XTuner's
    assert passes(set_epoch=lambda i: 2 * i + 1) == ([1, 3, 5], 3)
    assert passes(set_epoch=lambda i: None if i == 1 else i) == ([0, 2], 3)
    for kwargs, words in [({"set_epoch": None, "total_epoch": 1}, "leave total_epoch and total_step unset"),
                          ({"set_epoch": "manual", "total_epoch": 1}, "set_epoch must be"),
                          ({"state_hooks": (len,), "total_epoch": 1}, "state_hooks must be a pair"),
                          ({"first_epoch": 1.0, "total_epoch": 1}, "first_epoch must be an int"),
                          ({"build_on_every_rank": 3, "total_epoch": 1}, "build_on_every_rank must be"),
                          ({}, "or set_epoch=None for one pass per iter()")]:
        with pytest.raises(spbcast.Error, match=words) as info:
            spbcast.LeaderLoader(list, None, sp_media_dedup=False, **kwargs)
        assert info.value.code == "invalid_argument"
