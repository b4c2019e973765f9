"""LeaderLoader when a step fails - the leader's fetch raises, or yields a batch spbcast refuses -
and the trainer catches the error and goes on: every rank's default CPU generator stays BASE's
(every rank running its own loader, failing the same way) at every later step, and every rank's
step and epoch agree (a refused batch counts as a step, a fetch that raised does not)."""

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import spbcast
from dist_harness import run

RAISES, REFUSED, N, EPOCHS = 5, 9, 12, 2


class Flaky(Dataset):
    """Draws from the default generator per sample (num_workers=0: the main process's), then
    raises on one sample and returns a value spbcast refuses (a set of complex) on another."""

    def __init__(self, error=ValueError):
        self.error = error

    def __len__(self):
        return N

    def __getitem__(self, i):
        x = torch.rand(3 + i % 2)
        if i == RAISES:
            raise self.error("bad sample")
        if i == REFUSED:
            return {"x": x, "bad": {1j}}
        return {"x": x, "i": i}


def first(items):
    return items[0]


def make(workers):
    kw = dict(num_workers=workers, persistent_workers=workers > 0)
    if workers:
        kw["multiprocessing_context"] = "fork"
    return lambda: DataLoader(Flaky(), batch_size=1, collate_fn=first, **kw)


def _skip_errors(it, ll=None):
    """A trainer that skips a failed step: (what, generator after it, step, epoch) per step."""
    out = []
    while True:
        try:
            batch = next(it)
            what = "refused" if "bad" in batch else int(batch["i"])
        except StopIteration:
            return out
        except spbcast.Error as e:
            what = "refused" if "cannot send" in str(e) else "raised"
        except ValueError:  # BASE: the dataset's own error
            what = "raised"
        out.append((what, torch.get_rng_state(), ll and ll.step, ll and ll.epoch))
        torch.rand(2)  # the model step's own draws


def _mirror(rank, world, workers):
    torch.manual_seed(11)
    loader = make(workers)()
    base = []
    for _ in range(EPOCHS):
        base += _skip_errors(iter(loader))
    torch.manual_seed(11)
    ll = spbcast.LeaderLoader(make(workers), None, sp_media_dedup=True, total_epoch=EPOCHS)
    got = _skip_errors(iter(ll), ll)
    assert [g[0] for g in got] == [b[0] for b in base], [g[0] for g in got]
    step = 0
    for i, (b, g) in enumerate(zip(base, got)):
        assert torch.equal(b[1], g[1]), f"entry {i} ({g[0]}): default generator differs from BASE"
        step += g[0] != "raised"
        assert (g[2], g[3]) == (step, i // N), f"entry {i}: step, epoch {g[2:]}"
    assert ll.step == EPOCHS * (N - 1) and ll.epoch == EPOCHS
    assert spbcast.broadcast("ok" if rank == 0 else None) == "ok"  # the group is in step


@pytest.mark.parametrize("workers", [0, 2], ids=["0 workers", "2 persistent workers"])
def test_generator_mirror_survives_errors(workers):
    run(2 if workers else 3, _mirror, workers, timeout=150)


class Draws(Dataset):
    """Sample 1 draws more words than the (lowered) per-call bound, sample 2 reseeds."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        if i == 1:
            torch.rand(5000)
        if i == 2:
            torch.manual_seed(1234)
        return {"i": i}


def _draw_limits(rank, world):
    spbcast._loader.generators.MAX_WORDS_PER_CALL = 4096  # 64 Mi words by default: seconds to draw
    torch.manual_seed(3)
    ll = spbcast.LeaderLoader(lambda: DataLoader(Draws(), batch_size=1, collate_fn=first), None,
                              sp_media_dedup=True, total_epoch=1)
    it = iter(ll)
    assert int(next(it)["i"]) == 0
    with pytest.raises(spbcast.Error) as info:
        next(it)
    assert "no advance of at most 4,096 32-bit words (0.015625 MiB of random data) per call" in str(info.value)
    assert "drew more than that" in str(info.value) and "torch.Generator of its own" in str(info.value)
    with pytest.raises(spbcast.Error, match=r"it reseeded it \(torch.manual_seed"):
        next(it)
    assert int(next(it)["i"]) == 3  # the group goes on


def test_draws_that_cannot_be_mirrored_say_why():
    run(2, _draw_limits, timeout=120)


GROUP_TIMEOUT, LATE, HUNG = 4, 2.5, 6.5  # seconds


def _patience(rank, world, timeout, prefetch):
    # The SP group's own timeout is the patience of a step's first message, shorter or longer
    # than the loader's timeout: a leader late outside the loader (a checkpoint upload on rank 0)
    # or a follower late the same way (its own checkpoint shard) is not a failure; a leader hung
    # longer than it fails its followers within it, plus the 2 s grace.
    import datetime
    import time

    import torch.distributed as dist

    sp = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=GROUP_TIMEOUT))
    # An explicit root_wait overrides the group's, also where it is shorter than timeout.
    for explicit in (7, 0.5):
        assert spbcast.LeaderLoader(list, sp, sp_media_dedup=True, total_epoch=1, timeout=1,
                                    root_wait=explicit).root_wait == explicit
    ll = spbcast.LeaderLoader(lambda: [[torch.full((2,), i)] for i in range(5)], sp,
                              sp_media_dedup=True, total_epoch=1, timeout=timeout, prefetch=prefetch)
    assert ll.root_wait == GROUP_TIMEOUT
    it = iter(ll)
    assert next(it)[0].tolist() == [0, 0]
    for late, step in ((0, 1), (1, 2)):  # the leader late, then the follower
        if rank == late:
            time.sleep(LATE)
        assert next(it)[0].tolist() == [step, step], f"rank {late} late less than the group's timeout"
    if rank == 0:
        time.sleep(HUNG)  # its follower gave up meanwhile: the group is broken, whatever comes next
        return
    start = time.monotonic()
    with pytest.raises(spbcast.TransportError) as info:
        next(it)
        next(it)  # with prefetch, the step after the one received while the leader slept
    waited = time.monotonic() - start
    assert info.value.code == "timeout" and "root_wait" in str(info.value), str(info.value)
    assert waited <= GROUP_TIMEOUT + 2 + 0.5, f"gave up after {waited:.1f} s"
    if not prefetch:  # with prefetch the wait began at the step before
        assert waited >= GROUP_TIMEOUT - 0.5, f"gave up after {waited:.1f} s"


@pytest.mark.parametrize("timeout, prefetch", [(1, 0), (10, 1)], ids=["timeout-shorter", "timeout-longer-prefetch"])
def test_ranks_wait_as_long_as_the_group(timeout, prefetch):
    run(2, _patience, timeout, prefetch, timeout=60)


def _resume_after_failure(rank, world, workers):
    # A fetch that raised took its sample all the same: a checkpoint taken later in that epoch
    # resumes at the continuous run's next batch (the replay drops the failed fetch too), and
    # the KeyError a DataLoader worker raises (its message a str subclass of torch's) arrives as
    # a KeyError on every rank.
    def skip_errors(ll, until=None):
        out, it = [], iter(ll)
        while until is None or ll.step < until:
            try:
                batch = next(it)
                out.append("refused" if "bad" in batch else int(batch["i"]))
            except StopIteration:
                break
            except KeyError as e:
                assert isinstance(e, spbcast.LoaderError) and "bad sample" in str(e), repr(e)
                out.append("raised")
            except spbcast.Error as e:
                assert e.code == "unsupported_value", repr(e)
                out.append("refused")
        return out

    make_loader = lambda: DataLoader(Flaky(KeyError), batch_size=1, collate_fn=first,  # noqa: E731
                                     num_workers=workers, multiprocessing_context="fork" if workers else None)
    continuous = skip_errors(spbcast.LeaderLoader(make_loader, None, sp_media_dedup=True, total_epoch=1))
    ll = spbcast.LeaderLoader(make_loader, None, sp_media_dedup=True, total_epoch=1)
    before = skip_errors(ll, until=7)
    state = ll.state_dict()
    ll.close()
    resumed = spbcast.LeaderLoader(make_loader, None, sp_media_dedup=True, total_epoch=1)
    resumed.load_state_dict(state if rank == 0 else None)
    assert before + skip_errors(resumed) == continuous, (before, continuous)
    assert "raised" in before and "refused" in continuous


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_after_a_failed_fetch(workers):
    run(2, _resume_after_failure, workers)
