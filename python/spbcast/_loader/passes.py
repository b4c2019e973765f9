"""The pass: when a pass over the loader starts and ends, set_epoch, the one fetch/epoch loop,
carrying out a resume. Its calls into the loader go through leader_calls.py, which counts the
words they draw and defers the trainer's calls between steps to the dedup leader's next fetch."""

import time

import torch

from .generators import generator_states, persistent_iterator, replay_is_exact, set_generators, shut_down_workers
from .resume import replaying, start_persistent_workers
from .step_exchange import describe, envelope
from ..errors import Error

END = object()  # what a fetch returns at the end of the pass (or of the run)


class Steps:
    """A LeaderLoader's iterator. An error (a fetch that raised, a batch refused) does not end
    it, as it does not end a DataLoader's: a trainer that catches it calls next() again."""

    def __init__(self, next_step, passes):
        self._next_step, self._passes, self._done = next_step, passes, False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            done, batch = self._next_step()
        except BaseException:
            self._passes.mid_pass = True
            raise
        self._passes.mid_pass = not done
        if done:
            self._done = True
            self._passes.exhausted = not self._passes.per_pass
            raise StopIteration
        return batch


class Passes:
    """The passes over this rank's loader (None on dedup followers, which hold none), counted in
    ``position`` (resume.Position); its calls into the loader go through ``calls``
    (leader_calls.LeaderCalls)."""

    def __init__(self, position, calls, *, where, per_pass, total_epoch, total_step, epoch_for_pass):
        self.position, self._calls, self._where = position, calls, where
        self.per_pass, self.total_epoch, self.total_step = per_pass, total_epoch, total_step
        self._epoch_for_pass = epoch_for_pass  # pass index -> set_epoch value; None: the trainer's
        self.loader = None
        self.iter = None
        self.finished = False
        self.exhausted = False  # the whole run was iterated (the loader drives the epochs)
        # A step of the pass was taken and its end was not: the same on every SP rank (followers
        # hold no iterator), so a new iter() drops what was prefetched on all of them alike.
        self.mid_pass = False
        # Set on the prefetch thread: the pass's iterator is exhausted. The trainer's thread reads
        # it once every job is done (after the marker that said so was taken).
        self.pass_ended = False
        self.pass_generators = None  # the generators' states when the current pass began
        self.pass_resets_workers = False  # the pass's iter() reset persistent workers (no base seed)
        self.fetches_in_pass = 0  # next() calls on the pass's iterator, those that raised included
        # Resuming (resume() sets them): batches to drop, the saved pass's generators to replay
        # it from, persistent workers to start first, an epoch's end the loader's state restored.
        self.skip, self.replay_from, self.start_workers_first, self.end_of_epoch_pending = 0, None, False, False

    def build(self, make, counted):
        """The loader made by ``make`` and its first pass's set_epoch, if any: the words they
        drew (``counted``: the dedup leader's) and the loader's length (-1: it has no len())."""
        words = [0] if counted else None
        before = torch.get_rng_state() if counted else None
        self.loader = make()
        if counted:
            words[0] = self._calls.words(before, "building the loader")
        length = self.length()
        self.start(words)
        return (words[0] if counted else 0), length

    def length(self):
        try:
            return len(self.loader)
        except TypeError:
            return -1

    def leader_step(self, patience, exchange, channel, group):
        """The leader's envelope of a step fetched now, on the trainer's thread (the synchronous
        step; ``channel``: the prefetch's, or None: the steps travel on ``group``), and its own
        exception if the fetch raised."""
        sent, failure, started = envelope("step", 0, 0), None, time.monotonic()
        words = [self._calls.take_carried_words()]
        try:
            # While the leader fetches, the followers wait in the broadcast that follows:
            # keep-alive frames tell them it is still working.
            with patience.still_working(channel if channel is not None else group):
                self._calls.run_pending(words)
                with exchange.fetching_in_shared_memory(channel):
                    batch = self.fetch(words)
            sent["done"] = batch is END
            sent["batch"] = None if batch is END else batch
        except Exception as e:  # noqa: BLE001 - sent to the followers, re-raised by every rank
            failure = e
            sent["error"] = describe(e)
        sent["words"], sent["epoch"], sent["step"] = words[0], self.position.epoch, self.position.step
        sent["seconds"] = time.monotonic() - started
        return sent, failure

    # ---- the fetch/epoch loop -------------------------------------------------------------------

    def fetch(self, words):
        """The one fetch/epoch loop: the next batch of the current pass; at the end of a pass,
        start the next one (or, with set_epoch=None, end the iteration). Counts the generator
        words into words[0] (None: not counted, dedup is off)."""
        position = self.position
        if self.finished or (self.total_step is not None and position.step >= self.total_step):
            self.finished = True
            return END
        empty_passes = 0
        while True:
            if self.iter is None:
                self._begin_pass(words)
            batch = self._next_batch(words)
            if self.end_of_epoch_pending:
                self.end_of_epoch_pending = False
                if batch is END:  # the restored epoch's end (see resume.py)
                    self.iter = None
                    continue
            if batch is not END and self.skip > 0:
                self.skip -= 1
                continue
            if batch is not END:
                position.step += 1
                position.in_epoch += 1
                return batch
            if self.per_pass:  # the trainer starts the next pass (and calls set_epoch)
                self.iter, position.in_epoch, self.skip = None, 0, 0
                position.passes += 1
                return END
            self.end_pass(words)
            if self.total_epoch is not None and position.passes >= self.total_epoch:
                self.finished = True
                return END
            empty_passes += 1
            if empty_passes == 2:
                raise Error(self._where + ": the data loader yielded no batch for a whole epoch; "
                            "check the dataset and the sampler", "loader")

    def _begin_pass(self, words):
        if self.start_workers_first:
            self.start_workers_first = False
            start_persistent_workers(self.loader)
        if self.replay_from is not None:
            self._replay_pass()
        if self.iter is None:
            self.pass_ended = False
            self.pass_generators = generator_states(self.loader)
            self.fetches_in_pass = 0
            self.pass_resets_workers = persistent_iterator(self.loader) is not None
            self.iter = self._calls.counted(words, "creating the loader's iterator", iter, self.loader)

    def _next_batch(self, words):
        try:
            if self.pass_ended:  # a prefetched fetch found it ended (its marker was taken)
                self.pass_ended = False
                batch = END
            else:
                batch = self._calls.counted(words, "fetching a batch", next, self.iter, END)
        except Exception:
            self.fetches_in_pass += 1  # a fetch that raised took its samples all the same
            raise
        self.fetches_in_pass += batch is not END
        return batch

    def fetch_ahead(self, iterator):
        """On the leader's prefetch thread: the pass's next batch, or END. Its draws from the
        default generator are not counted: prefetch runs only where the fetch draws none in this
        process (see prefetch.py)."""
        return END if self.pass_ended else next(iterator, END)

    def mark_pass_ended(self):
        self.pass_ended = True

    def forget_pass_end(self):
        """What was prefetched is dropped: so is the pass's end one of them found."""
        self.pass_ended = False

    def took_prefetched(self, counted_as_step):
        """A prefetched step taken: a batch, or a batch spbcast refused, is a step; a fetch that
        raised is not, but it took its samples: the pass's fetch count (for a resume's replay)
        includes it."""
        if counted_as_step:
            self.position.step += 1
            self.position.in_epoch += 1
        self.fetches_in_pass += 1

    def ahead(self, in_flight):
        """The iterator and the step of a fetch ahead of the ``in_flight`` ones, or None where
        nothing may be fetched ahead: the pass or the run ends, or something is due on the
        trainer's thread first (its calls between steps, a resume still to apply)."""
        if (self.iter is None or self.pass_ended or self.finished or self._calls.due()
                or self.skip or self.replay_from is not None or self.end_of_epoch_pending
                or (self.total_step is not None and self.position.step + in_flight >= self.total_step)):
            return None
        return self.iter, self.position.step + in_flight + 1

    def record(self):
        """What the pass's order came from and how far it went, to replay it on resume, and
        where the next pass starts from (the default generator is the trainer's to save)."""
        return {"pass_generators": self.pass_generators, "fetches_in_pass": self.fetches_in_pass,
                "pass_resets_workers": self.pass_resets_workers,
                "next_pass_resets_workers": (persistent_iterator(self.loader) is not None
                                             or self.start_workers_first),
                "generators": {name: value for name, value in generator_states(self.loader).items()
                               if name != "default"}}

    def resume(self, decision, load):
        """Carries out resume.Decision ``decision``; ``load`` restores the loader's own state.
        Its calls into the loader run as the trainer's calls between steps do (leader_work)."""
        self.iter = None
        self.finished = self.exhausted = False
        self.pass_generators, self.fetches_in_pass = decision.pass_generators, decision.fetches_in_pass
        self.start_workers_first = decision.start_workers_first

        def restore(words):
            if decision.reapply is not None:
                self.set_epoch(decision.reapply, words)
            if decision.load_loader:
                self._calls.counted(words, "restoring the loader's state", load, decision.loader_state)
            set_generators(self.loader, decision.next_pass_generators)

        self._calls.leader_work("load_state_dict", restore)
        if decision.end_epoch:
            self._calls.leader_work("starting the next epoch", self.end_pass)
        self.skip, self.end_of_epoch_pending = decision.skip, decision.end_of_epoch_pending
        if decision.replay_from is not None:
            self.replay_from = decision.replay_from

    def refuse_if_exhausted(self):
        if self.exhausted:
            raise Error(self._where + ": this LeaderLoader has run all its "
                        + (f"{self.total_epoch} epochs" if self.total_epoch is not None else
                           f"{self.total_step} steps")
                        + " (it drives the epochs itself: one iteration is the whole run); make a new "
                        "one, or pass set_epoch=None for one pass per iter() as a DataLoader",
                        "invalid_argument")

    def restart(self):
        """A new iter() mid-pass (set_epoch=None): the next fetch starts a new pass."""
        self.iter, self.position.in_epoch, self.skip = None, 0, 0

    # ---- epochs ---------------------------------------------------------------------------------

    def start(self, words):
        """Before the first pass: set_epoch as the policy says for pass 0 (a callable only)."""
        if self._epoch_for_pass is not None:
            value = self._epoch_for_pass(0)
            if value is not None:
                self.set_epoch(value, words)

    def end_pass(self, words=None):
        position = self.position
        self.iter = None
        position.passes += 1
        position.epoch += 1
        position.in_epoch = 0
        if self.total_epoch is not None and position.passes >= self.total_epoch:
            return  # the last pass: no set_epoch for a pass that will not run (nor in BASE)
        value = self._epoch_for_pass(position.passes) if self._epoch_for_pass is not None else None
        if value is not None:
            self.set_epoch(value, words)

    def set_epoch(self, epoch, words=None):
        self.position.epoch_value = epoch
        for target in (self.loader, getattr(self.loader, "sampler", None),
                       getattr(self.loader, "batch_sampler", None),
                       getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if target is not None and hasattr(target, "set_epoch"):
                self._calls.counted(words, f"calling set_epoch({epoch!r}) on the loader", target.set_epoch, epoch)
                return

    # ---- resuming a pass ------------------------------------------------------------------------

    def _replay_pass(self):
        """Resuming mid-pass without the loader's own state: the pass started again from the
        generators it started from, the batches taken before the checkpoint dropped (see
        resume.replaying)."""
        saved, self.replay_from = self.replay_from, None
        with replaying(self.loader, saved):
            try:
                self.pass_resets_workers = persistent_iterator(self.loader) is not None
                self.iter = iter(self.loader)
                for _ in range(self.skip):
                    try:
                        if next(self.iter, END) is END:
                            break
                    except Exception:  # noqa: BLE001 - the continuous run raised it at its step
                        pass
            finally:
                self.pass_generators, self.fetches_in_pass, self.skip = saved, self.skip, 0

    def finish_pass_iterator(self, length):
        """Saved after an epoch's last batch, the resumed run starts the next pass from the
        loader's generators as they are now - but a sampler may still draw when its iterator is
        exhausted (RandomSampler draws once more past its last index), which the continuous
        run's next fetch does. So that fetch is made now, where it cannot yield a batch (one of
        torch's samplers over a map-style dataset: len() is exact), and the next fetch ends the
        pass without another."""
        if (self.iter is not None and not self.per_pass and 0 < length <= self.position.in_epoch
                and not self.pass_ended and replay_is_exact(self.loader)):
            batch = self._calls.outside_step("ending the pass", lambda: next(self.iter, END))
            if batch is not END:
                raise Error(self._where + f": the DataLoader yielded a batch past its len() "
                            f"({length}) in epoch {self.position.epoch}; spbcast cannot save its "
                            "position (its sampler's len() must be its number of indices)", "loader")
            self.pass_ended = True

    def close(self):
        for it in (self.iter, persistent_iterator(self.loader)):
            shut_down_workers(it)
        self.iter = self.loader = None
        self._calls.drop_pending()
