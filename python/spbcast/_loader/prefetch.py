"""The loader's side of prefetch: which depth (the policy), the leader's steps in flight on the
prefetch thread, settling and dropping them, and a follower's thread receiving envelopes. The
channel (a Gloo group of the SP ranks of the loader's own) and its thread are
../_prefetch_channel.py.

With prefetch, every step's envelope travels on the channel, in one order on every rank. The
leader's trainer thread, after taking step t, submits the fetch and broadcast of t + 1 .. t +
depth to its prefetch thread; a follower's prefetch thread receives envelopes one after another
from its first next() until the end of the data. What BASE does on the trainer's thread stays
there, at BASE's step: starting a pass (the iterator, its base seed, set_epoch), the trainer's
calls between steps, resuming. A prefetched fetch that finds its pass ended sends a "marker"
(nothing for this step: the leader's trainer thread sends it, synchronously); followers skip
markers. Where the leader drops what it prefetched (load_state_dict, a new iter() mid-pass) the
next envelope it sends is a synchronous one, and followers drop prefetched envelopes until they
see it."""

import collections
import concurrent.futures
import functools
import queue
import time

import torch

from .. import _prefetch_channel
from ..errors import Error, loader_error, type_name
from .generators import REPLAYABLE_SAMPLERS, sampler_of
from .passes import END
from .step_exchange import describe, envelope, receive_step


def default_policy(loader, requested, own_state):
    """LeaderLoader.prefetch_policy's default. Prefetch only where it keeps every rank's batches
    and generators BASE's: a torch DataLoader whose fetch runs in worker processes and whose
    sampler is torch's own (it draws from the default generator only when a pass starts, on the
    trainer's thread), and whose own state (``own_state``: it has one), if any, is torchdata's."""
    stateful = type(loader).__module__.startswith("torchdata.stateful_dataloader")
    if requested is not None:
        return requested, "prefetch=" + str(requested), ("snapshot" if own_state else None)
    if not isinstance(loader, torch.utils.data.DataLoader):
        return 0, (f"{type(loader).__name__} is not a torch DataLoader, so its fetch may draw "
                   "from the default CPU generator in this process (pass prefetch=1 if it "
                   "does not)"), None
    if loader.num_workers == 0:
        return 0, ("num_workers=0: the fetch runs in this process, where the dataset or the "
                   "collate function may draw from the default CPU generator (pass "
                   "prefetch=1 if they do not)"), None
    sampler = sampler_of(loader)
    if not (isinstance(loader.dataset, torch.utils.data.IterableDataset)
            or type(sampler) in REPLAYABLE_SAMPLERS):
        return 0, (f"the sampler {type(sampler).__name__} is not one of torch's, and it runs "
                   "in this process at every fetch (pass prefetch=1 if it draws nothing "
                   "from the default CPU generator)"), None
    if own_state and not stateful:
        return 0, (f"{type(loader).__name__} keeps its own position (state_dict), which "
                   "spbcast cannot take back by a batch fetched ahead (pass prefetch=1 "
                   "if its save hook is cheap and local: it is then taken before each "
                   "prefetched fetch)"), None
    return 1, f"a DataLoader with {loader.num_workers} workers", ("snapshot" if own_state else None)


def _follow(channel, leader, options, received):
    """A follower's prefetch thread: receives the leader's envelopes on the channel, in order,
    into ``received`` - until the end of the data (or of the pass), the leader's close, or an
    error, which is put there too for the trainer's thread to raise at its step."""
    while True:
        started = time.monotonic()
        try:
            body, refused = receive_step(channel, leader, options, "the next step")
        except BaseException as e:  # noqa: BLE001 - raised at the step that waits for it
            received.put(e)
            return
        received.put((body, refused, time.monotonic() - started))
        if type(body) is not dict or body.get("done") is not False or body.get("kind") == "stop":
            return


class Prefetch:
    """``depth`` steps fetched and broadcast ahead (0: none) and why (``reason``); how the
    loader's own state is taken with batches in flight (``state_mode``, see
    LeaderLoader.prefetch_policy)."""

    def __init__(self, passes, calls, exchange, patience, stats, *, where, is_leader):
        self._passes, self._calls, self._exchange = passes, calls, exchange
        self._patience, self._stats = patience, stats
        self._where, self._is_leader = where, is_leader
        self.depth, self.reason, self.state_mode = 0, "sp_media_dedup is off", None
        self.channel = self._thread = None
        self._in_flight = collections.deque()  # the leader's submitted steps
        self._listening = False  # the leader: its followers' threads are receiving envelopes
        self._following = None  # a follower: the job receiving envelopes, while it runs
        self._received = queue.Queue()  # a follower's received envelopes
        self._discarding = False  # a follower: skip prefetched envelopes until a synchronous one

    def start(self, depth, reason, state_mode, group, root_wait, rank):
        """Every SP rank, at the same point (the channel is a group of the SP ranks)."""
        self.depth, self.reason, self.state_mode = depth, reason, state_mode
        if depth:
            self.channel = _prefetch_channel.channel(group, root_wait)
            self._thread = _prefetch_channel.PrefetchThread(f"spbcast prefetch (rank {rank})")

    def take(self):
        """The leader: the outcome of the next step fetched ahead, or None where the trainer's
        thread fetches it now (none in flight, or the pass ended)."""
        self._listening = True
        while self._in_flight:
            job = self._in_flight.popleft()
            hit = job.done()
            outcome = job.result()  # waits without the GIL; raises the transport's error
            if outcome["kind"] == "marker":
                self.settle()  # the jobs after it found the pass ended too
                self._in_flight.clear()
                break
            self._stats.count_prefetch_hit(hit)
            return outcome
        return None

    def receive(self):
        """A follower: the next step's (envelope, refusal, seconds, prefetched)."""
        if self._following is None:
            self._following = self._thread.submit(functools.partial(
                _follow, self.channel, self._exchange.leader, self._exchange.options, self._received))
        while True:
            hit = not self._received.empty()
            item = self._received.get()  # waits without the GIL
            if isinstance(item, BaseException):
                self._following = None
                raise item
            received, refusal, seconds = item
            received = self._exchange.checked(received)
            kind = received["kind"]
            if kind == "stop":
                self._following = None
                raise Error(self._where + f": the SP leader (rank {self._exchange.leader}) closed its "
                            "LeaderLoader while this rank still iterates it: close it on every SP "
                            "rank at the same point", "out_of_step")
            if kind == "marker" or (self._discarding and kind == "prefetched"):
                continue
            self._discarding = False
            break
        if received["done"]:
            self._following = None
        self._stats.count_prefetch_hit(hit and kind == "prefetched")
        return received, refusal, seconds, kind == "prefetched"

    def step_taken(self, done, closed, save):
        """The leader, after a step: at the end of the data the followers' threads stop;
        otherwise keep ``depth`` steps in flight while the pass goes on. ``save``: the loader's
        save hook (or None), taken before each prefetched fetch where state_mode says so."""
        if done:
            self._listening = False
            return
        while len(self._in_flight) < self.depth and not closed:
            ahead = self._passes.ahead(len(self._in_flight))
            if ahead is None:
                return
            iterator, step = ahead
            self._in_flight.append(self._thread.submit(functools.partial(
                self._prefetched_step, iterator, save if self.state_mode == "snapshot" else None, step)))

    def _prefetched_step(self, iterator, save, step):
        """On the leader's prefetch thread: fetch the pass's next batch and broadcast it on the
        channel."""
        sent = envelope("prefetched")
        outcome = {"failure": None, "snapshot": None, "batch": None}
        started = time.monotonic()
        try:
            with self._patience.still_working(self.channel):
                if save is not None:  # the loader's state before this fetch, for state_dict
                    try:
                        outcome["snapshot"] = save()
                    except Exception as e:  # noqa: BLE001 - raised by state_dict, if it is asked for
                        outcome["snapshot"] = e
                with self._exchange.fetching_in_shared_memory(self.channel):
                    batch = self._passes.fetch_ahead(iterator)
            if batch is END:
                self._passes.mark_pass_ended()
                sent["kind"] = "marker"
            else:
                sent["batch"] = outcome["batch"] = batch
        except Exception as e:  # noqa: BLE001 - raised at its step on every rank
            outcome["failure"] = e
            sent["error"] = describe(e)
        sent["seconds"] = time.monotonic() - started
        sending = time.monotonic()
        received, refusal = self._exchange.send(sent, self.channel, f"step[{step}]")
        outcome.update(kind=sent["kind"], received=received, seconds=time.monotonic() - sending)
        outcome["failure"] = outcome["failure"] or refusal
        return outcome

    def settle(self):
        """Waits until the leader's prefetch thread has run every job submitted (each sent its
        envelope), whatever their outcome; they stay to be taken."""
        concurrent.futures.wait(self._in_flight)

    def drop(self):
        """On every SP rank, at the same point: what was prefetched is not taken (a resume, a
        new pass mid-pass). The leader's next envelope is a synchronous step; the followers skip
        the prefetched ones before it."""
        if not self.depth:
            return
        if self._is_leader:
            self.settle()
            self._in_flight.clear()
        elif self._following is not None:
            self._discarding = True
        self._passes.forget_pass_end()

    def loader_state(self, save, args, kwargs, rewound):
        """The loader's own state as of the last step taken: with batches prefetched, taken back
        by them (``rewound``: LeaderLoader.rewound, where state_mode is "rewind")."""
        outcomes = [job.result() for job in self._in_flight]
        calls = self._calls
        if not outcomes:
            return calls.outside_step("taking the loader's state", lambda: save(*args, **kwargs))
        if self.state_mode == "rewind":
            batches = [o["batch"] for o in outcomes if o["batch"] is not None]
            with rewound(batches):
                state = calls.outside_step("taking the loader's state", lambda: save(*args, **kwargs))
        elif args or kwargs:
            raise Error(self._where + ": the loader's state was asked for with arguments while "
                        "batches are prefetched; spbcast took it before the first of them without "
                        "arguments: call get_state_dict() without them, or pass prefetch=0",
                        "invalid_argument")
        else:
            state = outcomes[0]["snapshot"]
            if isinstance(state, BaseException):
                raise loader_error(self._where + f": taking the loader's state raised "
                                   f"{type_name(type(state))}: {state}", type_name(type(state)),
                                   str(state), type(state)) from state
        if calls.carried_words:
            raise Error(self._where + f": the loader's calls outside the steps drew "
                        f"{calls.carried_words} words from the default CPU generator while batches "
                        "were prefetched: the followers cannot mirror them at their step; pass "
                        "prefetch=0 for this loader", "loader")
        return state

    def close(self):
        if self._thread is None or not self._thread.usable():
            return
        wait = self._patience.closing_wait()
        try:
            if self._is_leader:
                self.settle()
                self._in_flight.clear()
                if self._listening:  # the followers' threads are receiving: end them
                    stop = envelope("stop")
                    self._thread.submit(lambda: self._exchange.send(stop, self.channel, "stop")).result(wait)
            elif self._following is not None:
                concurrent.futures.wait([self._following], wait)
        except Exception:  # noqa: BLE001 - closing: a peer gone already is no error of close's
            pass
        if self._thread.stop(wait):
            _prefetch_channel.release(self.channel)

    def stop_thread(self):
        """The loader collected: its thread ends once its jobs are done (no message to peers)."""
        if self._thread is not None and self._thread.usable():
            self._thread.stop(0)
