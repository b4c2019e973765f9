"""Position and resume: what a LeaderLoader state holds (state_dict) and how a run continues from
one (load_state_dict): the last epoch given to set_epoch again, the loader's own state restored,
or - for a loader without one - the pass replayed from the generators it started from; and the
ResumeWarning where what spbcast cannot restore may change the order. Resume decides
(``Resume.decide``); the pass carries the decision out (``Passes.resume``)."""

import contextlib
import dataclasses
import warnings

import torch

from .generators import (borrowed_generators, keeps_workers, persistent_iterator, replay_is_exact,
                         sampler_of, set_generators)
from .step_exchange import describe
from ..errors import Error, LoaderError, ResumeWarning

# 2 added the pass index and the last set_epoch value; 3 the pass's generators; 4 whether the
# pass reset persistent workers, whether the next one will, and the loader's own generators now.
STATE_VERSION = 4
STATE_VERSIONS = tuple(range(1, STATE_VERSION + 1))  # the versions load_state_dict reads


def save_hook(loader, state_hooks):
    """The loader's own state call: the save hook, state_dict() or get_state_dict(); or None."""
    if state_hooks is not None:
        save = state_hooks[0]
        return lambda *a, **k: save(loader, *a, **k)
    for name in ("state_dict", "get_state_dict"):
        fn = getattr(loader, name, None)
        if callable(fn):
            return fn
    return None


def load_hook(loader, state_hooks):
    if state_hooks is not None:
        load = state_hooks[1]
        return lambda state: load(loader, state)
    fn = getattr(loader, "load_state_dict", None)
    return fn if callable(fn) else None


def warn_of_resume(message):
    if message is not None:
        warnings.warn(message, ResumeWarning, stacklevel=3)


def own_sampler(loader):
    """A DataLoader's sampler that is not one of torch's (what it carries from one pass to
    the next spbcast cannot restore), or None."""
    if (not isinstance(loader, torch.utils.data.DataLoader) or replay_is_exact(loader)
            or isinstance(loader.dataset, torch.utils.data.IterableDataset)):
        return None
    return sampler_of(loader)


class Position:
    """Where the loop is: ``epoch`` (the trainer's numbering), ``step`` (steps of the run taken),
    ``in_epoch`` (batches of the pass taken), ``passes`` (passes completed), ``epoch_value``
    (the last value given to the loader's set_epoch). Counted by the pass (passes.py); a state holds it."""

    def __init__(self, epoch):
        self.epoch, self.step, self.in_epoch, self.passes, self.epoch_value = epoch, 0, 0, 0, None


def start_persistent_workers(loader):
    """Resuming a DataLoader with persistent workers that the continuous run started in an
    earlier pass: there the next pass's iter() reset them and drew no base seed, where a
    fresh DataLoader's first iter() draws one before the sampler's seed - a pass order one
    draw off, and a default generator that is no longer BASE's. So its workers are started
    first, with every generator borrowed, and the pass's iter() resets them as in the
    continuous run. (The few samples they fetch meanwhile are dropped by that reset.)"""
    if persistent_iterator(loader) is None:
        with borrowed_generators(loader):
            iter(loader)


@contextlib.contextmanager
def replaying(loader, generators):
    """Resuming mid-pass without the loader's own state: inside, the pass is started again from
    the ``generators`` it started from and the batches taken before the checkpoint are drawn and
    dropped, so the order is the continuous run's. The default generator is the trainer's: it is
    borrowed for the replay and given back as it was (nothing to mirror); the loader's own
    generators end where the continuous run's are."""
    trainers = torch.get_rng_state()
    set_generators(loader, generators)
    try:
        yield
    finally:
        torch.set_rng_state(trainers)


@dataclasses.dataclass
class Decision:
    """How a resumed run goes on (Passes.resume carries it out): ``load_loader`` - restore the
    loader's own state (``loader_state``); ``reapply`` - the set_epoch value to give again, or
    None; ``next_pass_generators`` - the loader's generators where the next pass starts;
    ``pass_generators`` / ``fetches_in_pass`` - the pass's record; ``start_workers_first`` (see
    start_persistent_workers); ``end_epoch`` - saved after an epoch's last batch: start the next;
    ``end_of_epoch_pending`` - the loader's state restored that epoch's end; ``skip`` - batches
    to drop; ``replay_from`` - the generators to replay the pass from; ``warning`` - what to
    warn of (ResumeWarning), or None."""
    load_loader: bool
    loader_state: object
    reapply: object
    next_pass_generators: dict
    pass_generators: object
    fetches_in_pass: int
    start_workers_first: bool
    end_epoch: bool = False
    end_of_epoch_pending: bool = False
    skip: int = 0
    replay_from: object = None
    warning: object = None


class Resume:
    """The loop's ``position`` and how a state restores it."""

    def __init__(self, position, *, where, per_pass):
        self.position, self._where, self._per_pass = position, where, per_pass

    def state(self, loader_state=None, record=None):
        """The state: the position, the loader's own state, or (``record``: Passes.record()) what
        replays the pass."""
        p = self.position
        state = {"version": STATE_VERSION, "epoch": p.epoch, "pass": p.passes, "step": p.step,
                 "in_epoch": p.in_epoch, "epoch_value": p.epoch_value, "loader": loader_state}
        if record is not None:
            state.update(record)
        return state

    def decide(self, state, loader, length, has_load):
        """The position ``state`` holds (set now) and how the pass over ``loader`` (``length``
        batches, or -1) goes on; ``has_load``: the loader has a load hook."""
        if not isinstance(state, dict) or state.get("version") not in STATE_VERSIONS:
            raise Error(self._where + ": load_state_dict got a state that LeaderLoader."
                        "state_dict did not write; pass the SP leader's state_dict()",
                        "invalid_argument")
        p = self.position
        p.epoch, p.step, p.in_epoch = state["epoch"], state["step"], state["in_epoch"]
        if state["version"] == 1:  # epochs counted from 0, set_epoch(epoch) from the second on
            p.passes = p.epoch
            p.epoch_value = p.epoch or None
        else:
            p.passes, p.epoch_value = state["pass"], state["epoch_value"]
        own_state = state["loader"] is not None and has_load
        # Resumed where a pass starts (before the first step, after an epoch's last batch), the
        # next pass starts from the loader's generators as the continuous run has them now; resumed
        # mid-pass, the replay sets them to where the pass began.
        at_pass_start = p.in_epoch == 0 or (not self._per_pass and 0 < length <= p.in_epoch)
        resets_workers = not own_state and state.get(
            "next_pass_resets_workers" if at_pass_start else "pass_resets_workers", False)
        # Where spbcast drove set_epoch, giving the last value again is its part of the resume
        # (the loader's own state may not hold the epoch); where the trainer drives it, the
        # trainer's resume does that, so only the drop-based fast-forward needs it.
        reapply = p.epoch_value is not None and (not self._per_pass or not own_state)
        decision = Decision(
            load_loader=own_state, loader_state=state["loader"], reapply=p.epoch_value if reapply else None,
            next_pass_generators=state.get("generators", {}) if at_pass_start and not own_state else {},
            pass_generators=state.get("pass_generators"), fetches_in_pass=state.get("fetches_in_pass", p.in_epoch),
            start_workers_first=resets_workers and keeps_workers(loader))
        warnings_ = self._how_the_pass_goes_on(decision, loader, length)
        warnings_ += self._what_is_not_restored(decision, loader, at_pass_start, resets_workers)
        decision.warning = "; and ".join(self._where + ": " + w for w in warnings_) or None
        return decision

    def _how_the_pass_goes_on(self, decision, loader, length):
        p = self.position
        if not self._per_pass and length > 0 and p.in_epoch >= length:
            # Saved right after an epoch's last batch: the continuous run ends that pass at its
            # next fetch, so the resumed run starts the next epoch. A loader whose own state
            # knows that its epoch was consumed (torchdata's StatefulDataLoader) gives one empty
            # iterator first, the end of that epoch: it is not a pass of its own.
            decision.end_epoch, decision.end_of_epoch_pending = True, decision.load_loader
            return []
        if decision.load_loader:
            return []
        decision.skip = p.in_epoch
        generators = decision.pass_generators
        if decision.skip > 0 and generators is not None and replay_is_exact(loader):
            decision.replay_from = generators
            decision.skip = decision.fetches_in_pass
            return []
        if decision.skip == 0:
            return []
        return [f"resuming mid-epoch (step {p.in_epoch} of epoch {p.epoch}) by dropping "
                f"the epoch's first {decision.skip} batches, which gives the continuous run's "
                "batches only if the loader's order depends on nothing but the epoch given to "
                "set_epoch: "
                + ("the state holds no generators of the pass (written by an older spbcast)"
                   if generators is None else
                   f"{type(loader).__name__} is not a DataLoader with one of torch's "
                   "samplers, whose pass spbcast replays from its generators")
                + "; give the loader state of its own (state_dict / load_state_dict, "
                "torchdata's StatefulDataLoader) or state_hooks=, or silence "
                "spbcast.ResumeWarning if the order is the epoch's alone"]

    def _what_is_not_restored(self, decision, loader, at_pass_start, resets_workers):
        p, found = self.position, []
        # The epoch the resumed run goes on in (after an epoch's last batch: the next one).
        resumed_epoch, resumed_pass = (p.epoch + 1, p.passes + 1) if p.in_epoch and at_pass_start \
            else (p.epoch, p.passes)
        sampler = own_sampler(loader)
        if not decision.load_loader and at_pass_start and resumed_pass > 0 and sampler is not None:
            found.append(
                f"resuming at the start of epoch {resumed_epoch}: the sampler "
                f"{type(sampler).__name__} is not one of torch's, and what it carries "
                "from one pass to the next (its own generators, Python's or numpy's) is not "
                "restored; give the loader state of its own (state_dict / load_state_dict, "
                "torchdata's StatefulDataLoader) or state_hooks=, or silence "
                "spbcast.ResumeWarning if its order is the epoch's alone")
        if resets_workers:
            found.append(_persistent_workers_warning(resumed_epoch, decision.start_workers_first))
        return found

    def load_on_group(self, exchange, is_leader, load):
        """load_state_dict under dedup, a collective over the SP group: ``load()`` on the leader
        (it returns what to warn of), then every rank takes its outcome - the warning, or the
        leader's failure raised on every rank."""
        outcome, failure = {"error": None, "warning": None}, None
        if is_leader:
            try:
                outcome["warning"] = load()
            except Exception as e:  # noqa: BLE001 - sent to the followers, re-raised below
                failure = e
                outcome["error"] = describe(e)
        outcome = exchange.checked_load_outcome(exchange.broadcast(outcome, "load_state_dict"))
        if outcome["error"] is None:
            return outcome["warning"]
        if isinstance(failure, Error) and not isinstance(failure, LoaderError):
            raise failure  # the leader's own words about the state it was given
        raise exchange.leader_failed("loading its state", outcome["error"], failure)


def _persistent_workers_warning(resumed_epoch, workers_started_first):
    return (f"resuming epoch {resumed_epoch} of a DataLoader with persistent workers "
            "(persistent_workers=True), which the continuous run started in an earlier pass: "
            "the resumed run starts them anew, so what they draw (augmentation with torch's, "
            "Python's or numpy's generators in the dataset or collate_fn) is not the "
            "continuous run's - their generators carried over from the earlier passes"
            + ("" if workers_started_first else
               ", and nor may the sample order be (this torch's DataLoader keeps no "
               "persistent iterator where spbcast looks: DataLoader._iterator)")
            + "; for exact worker-side randomness use torchdata's StatefulDataLoader (it "
            "snapshots its workers) or persistent_workers=False, or silence "
            "spbcast.ResumeWarning if the workers draw nothing")
