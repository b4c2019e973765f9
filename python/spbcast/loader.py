"""LeaderLoader: only the SP leader runs the data loader; every rank of the SP group gets its
batches, and every follower's default CPU generator advances as if it had run its own loader.
The Python counterpart of include/spbcast/loader.hpp: the story of one step, told over its parts
(spbcast/_loader; docs/internals.md maps them to the C++ ones)."""

import os
import time

import torch.distributed as dist

from . import _prefetch_channel
from ._broadcast import _group_and_root
from ._extension import BUILT_WITH_TORCH
from ._loader import config
from ._loader.leader_calls import LeaderCalls
from ._loader.passes import END, Passes, Steps
from ._loader.patience import Patience
from ._loader.prefetch import Prefetch, default_policy
from ._loader.resume import Position, Resume, load_hook, save_hook, warn_of_resume
from ._loader.stats import Stats
from ._loader.step_exchange import StepExchange
from .errors import Error


class LeaderLoader:
    """Iterates the batches of a data loader on every rank of ``sp_group``, loading them on the
    SP leader only: ``total_epoch`` passes or ``total_step`` steps, or - with ``set_epoch=None``
    - one pass per ``iter()``, as the loader itself, for a host trainer that drives the epochs.
    docs/python.md ("The leader-only loader") says each option's details.

    make_loader: a callable returning an iterable loader (e.g. a torch.utils.data.DataLoader),
        called on the SP leader (group rank 0) only under dedup; with ``build_on_every_rank``
        it gets that callable's result (run on every SP rank first: its draws need no mirror).
    sp_group: the SP process group (None: the default group).
    sp_media_dedup: off means every rank runs its own loader (BASE), as without spbcast.
    first_epoch: the number of the first pass (the ``epoch`` attribute); 1 for XTuner.
    set_epoch: "auto" (default): ``set_epoch(first_epoch + pass)`` before each pass after the
        first; a callable: ``set_epoch(pass_index)`` gives the loader's set_epoch value before
        each pass, the first included (None: no call); None: the host trainer drives the epochs
        (each ``iter()`` one pass, ``len()`` the loader's, its ``set_epoch(e)`` reaches the
        leader's loader), and total_epoch and total_step stay unset.
    state_hooks: ``(save, load)``: ``save(loader, *args, **kwargs)`` returns the loader's state,
        ``load(loader, state)`` restores it. By default the loader's own ``state_dict()`` or
        ``get_state_dict()`` (XTuner's Dataloader) and ``load_state_dict()``.
    tp_size: dedup requires tensor parallelism 1.
    timeout: seconds (or a timedelta) bounding the transport of each step's broadcast (default
        5 minutes); a leader slower to build its loader or fetch a batch sends keep-alive frames.
    root_wait: seconds (or a timedelta) a step's first message waits for a peer late outside the
        loader (a checkpoint, an evaluation); None (default): the SP group's own timeout.
    transport, relay_chunk_bytes: as in ``spbcast.broadcast`` ("auto", "network",
        "shared_memory" or "hierarchical"; the hierarchical path's chunk, None: 4 MiB).
    log_every, log: every ``log_every`` steps (0: never) and at the end of the data, a summary
        of ``stats()`` goes to ``log`` (default: the ``spbcast`` logger, at INFO).
    leader_allocates_in_shared_memory: on the same-host path the leader fetches each batch inside
        ``spbcast.shared_memory()``, so the broadcast copies nothing.
    prefetch: how many steps the leader fetches and broadcasts ahead while the trainer runs its
        step (on a thread of each rank and a Gloo group of the loader's own). None (default):
        ``prefetch_policy(None)`` - 1 where that keeps every rank's batches and generators
        BASE's, else 0; ``prefetch_reason`` says why. An int: that depth, where the caller
        vouches that the fetch draws nothing from the default CPU generator in this process.

    Every SP rank must iterate in step. ``state_dict()`` (or ``get_state_dict(...)``) is the SP
    leader's position (followers return {} and touch nothing, so a state call of the loader that
    is a collective over its DP group is made by the leaders of all DP replicas together, as in
    BASE); ``load_state_dict()`` is called on every SP rank - a collective over the SP group -
    with the leader's state on the leader (followers' state is ignored: None will do).
    """

    def __init__(self, make_loader, sp_group=None, *, sp_media_dedup, total_epoch=None,
                 total_step=None, first_epoch=0, set_epoch="auto", build_on_every_rank=None,
                 state_hooks=None, tp_size=1, timeout=None, root_wait=None, transport="auto",
                 relay_chunk_bytes=None, leader_allocates_in_shared_memory=True, prefetch=None,
                 log_every=100, log=None):
        rank = dist.get_rank() if dist.is_initialized() else 0
        config.check(f"spbcast: rank {rank}: invalid LeaderLoader configuration: ", make_loader,
                     sp_media_dedup=sp_media_dedup, total_epoch=total_epoch, total_step=total_step,
                     first_epoch=first_epoch, set_epoch=set_epoch, build_on_every_rank=build_on_every_rank,
                     state_hooks=state_hooks, tp_size=tp_size, timeout=timeout, root_wait=root_wait,
                     transport=transport, relay_chunk_bytes=relay_chunk_bytes, prefetch=prefetch,
                     log_every=log_every)
        self.total_epoch, self.total_step, self.first_epoch = total_epoch, total_step, first_epoch
        self.per_pass = set_epoch is None
        self.state_hooks, self.timeout, self.transport = state_hooks, timeout, transport
        self.relay_chunk_bytes = relay_chunk_bytes
        self.leader_allocates_in_shared_memory = bool(leader_allocates_in_shared_memory)
        self.length, self._closed, self._pid = -1, False, os.getpid()
        self.group = sp_group if sp_group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.rank = rank  # global, as every spbcast message names ranks
        self.sp_rank = dist.get_rank(self.group) if self.group is not None else 0
        self.dedup = bool(sp_media_dedup) and (dist.get_world_size(self.group) if self.group is not None else 1) > 1
        self._leader = dist.get_global_rank(self.group, 0) if self.dedup else rank
        self._make_parts(first_epoch, set_epoch, root_wait, log_every, log)
        if build_on_every_rank is not None:  # what BASE builds on every rank too: nothing to mirror
            shared = build_on_every_rank()
            make = lambda: make_loader(shared)  # noqa: E731
        else:
            make = make_loader
        if not self.dedup:
            self.length = self._passes.build(make, counted=False)[1]
            return
        # The group is checked on every rank (a CPU backend, ...) before the leader's keep-alive
        # would use it alone.
        _group_and_root(self.group, self._leader)
        self._init_group(make, prefetch)

    def _make_parts(self, first_epoch, set_epoch, root_wait, log_every, log):
        where = self._where()
        position = Position(first_epoch)
        epoch_for_pass = (lambda i: None if i == 0 else first_epoch + i) if set_epoch == "auto" else set_epoch
        self._patience = Patience(self.group, self._leader, timeout=self.timeout, root_wait=root_wait,
                                  transport=self.transport, dedup=self.dedup)
        options = dict(timeout=self.timeout, root_wait=self.root_wait, transport=self.transport,
                       relay_chunk_bytes=self.relay_chunk_bytes)  # each broadcast's, as spbcast.broadcast's
        self._exchange = StepExchange(self.group, self._leader, rank=self.rank, is_leader=self.is_leader, where=where,
                                      options=options, allocate_in_shared_memory=self.leader_allocates_in_shared_memory)
        self._stats = Stats(where, self.is_leader, self.is_leader or not self.dedup, log_every, log)
        self._calls = LeaderCalls(where, self.dedup)
        self._passes = Passes(position, self._calls, where=where, per_pass=self.per_pass, total_epoch=self.total_epoch,
                              total_step=self.total_step, epoch_for_pass=epoch_for_pass)
        self._resume = Resume(position, where=where, per_pass=self.per_pass)
        self._fetch_ahead = Prefetch(self._passes, self._calls, self._exchange, self._patience, self._stats,
                                     where=where, is_leader=self.is_leader)

    def _init_group(self, make, prefetch):
        def build(init):  # the leader's part of loader_init: building may take longer than timeout
            with self._patience.still_working(self.group):
                init["words"], init["length"] = self._passes.build(make, counted=True)
                init["prefetch"], init["prefetch_reason"], state_mode = self.prefetch_policy(prefetch)
                return state_mode

        init, state_mode = self._exchange.loader_init(build)
        if not self.is_leader:
            self._calls.mirror(init["words"], self._leader)
        self.length = init["length"]
        self._fetch_ahead.start(init["prefetch"], init["prefetch_reason"], state_mode, self.group,
                                self.root_wait, self.rank)
        if self.prefetch:
            _prefetch_channel.close_at_exit(self)

    is_leader = property(lambda self: self.sp_rank == 0)
    loader = property(lambda self: self._passes.loader, doc="The loader (None on dedup followers).")
    epoch = property(lambda self: self._resume.position.epoch,
                     lambda self, value: setattr(self._resume.position, "epoch", value))
    step = property(lambda self: self._resume.position.step,
                    lambda self, value: setattr(self._resume.position, "step", value))
    root_wait = property(lambda self: self._patience.root_wait)
    prefetch = property(lambda self: self._fetch_ahead.depth)
    prefetch_reason = property(lambda self: self._fetch_ahead.reason)
    log_every = property(lambda self: self._stats.log_every)

    def __len__(self):
        """Steps of the whole run: total_step, or batches per epoch times total_epoch; with
        set_epoch=None, batches per pass (the loader's len)."""
        if self.total_step is not None:
            return self.total_step
        if self.length < 0:
            raise TypeError("the loader has no len(), so the number of steps is unknown")
        return self.length if self.per_pass else self.length * self.total_epoch

    def __iter__(self):
        if self._closed:
            raise Error(self._where() + ": this LeaderLoader is closed", "invalid_argument")
        self._passes.refuse_if_exhausted()
        if self.per_pass:
            # One pass per iter(), as the loader's own: a new iter() starts a new pass, except
            # the first after load_state_dict, which continues where the state was taken.
            if self._passes.mid_pass:
                self._fetch_ahead.drop()
                self._passes.restart()
            self._passes.finished = False
        return Steps(self._next, self._passes)

    def set_epoch(self, epoch):
        """The host trainer's set_epoch: the epoch of the next pass (and the ``epoch`` attribute).
        Call it on every SP rank, as on the loader itself. It reaches the loader (or its sampler)
        on the leader - on the dedup leader at its next fetch, inside the step, its generator
        words sent with that step - and nothing on the followers."""
        if not self.per_pass:
            raise Error(self._where() + f": set_epoch({epoch!r}) on a LeaderLoader that drives the "
                        "epochs itself (total_epoch / total_step): it calls the loader's set_epoch "
                        "as set_epoch= says; pass set_epoch=None to drive the epochs from the trainer",
                        "invalid_argument")
        self.epoch = epoch
        if self.loader is not None:
            self._calls.leader_work(f"calling the loader's set_epoch({epoch!r})",
                                    lambda words, passes=self._passes: passes.set_epoch(epoch, words))

    def close(self):
        """Stops what the loader started on this rank: its iterator (a DataLoader's worker
        processes with it, persistent ones included) and the loader itself. Call it on every
        SP rank (nothing in it is a collective); the loader cannot be iterated afterwards.
        ``with LeaderLoader(...) as loader:`` closes it on leaving the block."""
        if self._closed:
            return
        self._closed = True
        if os.getpid() != self._pid:
            return  # a forked child (a DataLoader worker): the workers and thread are the parent's
        self._fetch_ahead.close()
        self._passes.close()

    def __enter__(self):
        return self

    def __del__(self):
        # Collected at any time, on each rank at its own: no message to the peers, and the
        # channel stays (destroying it here would change the names of the next groups made on
        # this rank and not on its peers): only the prefetch thread ends, once its jobs are done.
        if getattr(self, "_fetch_ahead", None) is not None:
            self._fetch_ahead.stop_thread()

    def __exit__(self, *exc):
        self.close()

    def state_dict(self):
        """The loop position and the loader's own state (state_dict(), get_state_dict() or the save
        hook); empty on dedup followers, which hold no loader and call nothing. Save the leader's."""
        return self.get_state_dict()

    def get_state_dict(self, *args, **kwargs):
        """state_dict() under the name XTuner's Dataloader uses; the arguments go to the loader's
        own state call. Where that call is a collective over the loader's DP group, the leaders
        of all DP replicas call it together (followers return {} and call nothing)."""
        if self.loader is None:
            return {}
        self._fetch_ahead.settle()  # the prefetched fetches are done: the loader is not in use
        self._calls.run_pending_outside_step()
        save = save_hook(self.loader, self.state_hooks)
        if save is not None:
            return self._resume.state(loader_state=self._fetch_ahead.loader_state(save, args, kwargs, self.rewound))
        self._passes.finish_pass_iterator(self.length)
        return self._resume.state(record=self._passes.record())

    def load_state_dict(self, state):
        """Continues exactly where state_dict() was taken, from the next batch: the last epoch
        given to set_epoch again, then the loader's own state restored - or, without one, the
        resumed epoch replayed from the generators it began with (exact for a DataLoader with one
        of torch's samplers; any other loader warns, ResumeWarning, on every SP rank). Under dedup
        a collective over the SP group: call it on every SP rank (followers' state is ignored:
        None will do); what the leader's load raised is raised on every SP rank, here."""
        self._passes.mid_pass = False  # the first iter() after it continues where the state was taken
        if not self.dedup:
            warn_of_resume(self._load(state))
            return
        self._fetch_ahead.drop()
        warn_of_resume(self._resume.load_on_group(self._exchange, self.is_leader, lambda: self._load(state, True)))

    def _load(self, state, now=False):
        # now: the dedup leader runs its calls into the loader at once (their errors are load's).
        load = load_hook(self.loader, self.state_hooks)
        decision = self._resume.decide(state, self.loader, self.length, load is not None)
        self._passes.resume(decision, load)
        if now:
            self._calls.run_pending_outside_step()
        return decision.warning

    def stats(self):
        """What the loop's broadcasts did on this rank, so far (docs/python.md says each): ``path``
        ("same_host", "hierarchical", "network"; "local": no dedup), ``steps``, ``bytes``, ``loader_seconds``
        (the leader's), ``broadcast_seconds``, ``leader_loader_seconds`` (a follower: the leader's for the
        same steps), ``wait_seconds``, ``prefetch``, ``prefetch_reason``, ``prefetch_hits``, ``built_with_torch``."""
        return dict(self._stats.counts, path=self._exchange.path(self._fetch_ahead.channel, self.dedup),
                    prefetch=self.prefetch, prefetch_reason=self.prefetch_reason, built_with_torch=BUILT_WITH_TORCH)

    def prefetch_policy(self, requested):
        """On the leader, once its loader is built: ``(depth, why, state_mode)`` for ``prefetch=
        requested`` (None: the default). ``state_mode`` says how the loader's own state is taken
        with batches in flight: None - it has none; "snapshot" - its save hook before each
        prefetched fetch; "rewind" - inside ``rewound(batches)``. By default prefetch only where
        it keeps every rank's batches and generators BASE's (docs/python.md)."""
        return default_policy(self.loader, requested, save_hook(self.loader, self.state_hooks) is not None)

    def rewound(self, batches):
        """A context in which the loader's own state is as before the prefetched ``batches``
        (fetched but not taken), for a prefetch_policy whose state_mode is "rewind"."""
        raise NotImplementedError

    def _next(self):
        started = time.monotonic()
        if not self.dedup:
            batch = self._passes.fetch(None)
            received = {"done": batch is END, "seconds": time.monotonic() - started}
            self._stats.count_step(received, batch, 0.0, time.monotonic() - started, self._summary)
            return batch is END, (None if batch is END else batch)
        if self.prefetch and not self.is_leader:
            received, refusal, seconds, prefetched = self._fetch_ahead.receive()
            return self._consume(received, refusal, seconds, time.monotonic() - started, prefetched)
        outcome = self._fetch_ahead.take() if self.prefetch else None
        if outcome is not None:
            return self._consume(outcome["received"], outcome["failure"], outcome["seconds"],
                                 time.monotonic() - started, prefetched=True)
        channel = self._fetch_ahead.channel
        envelope, failure = (self._passes.leader_step(self._patience, self._exchange, channel, self.group)
                             if self.is_leader else (None, None))
        sending = time.monotonic()
        received, refusal = self._exchange.send(envelope, channel if channel is not None else self.group)
        now = time.monotonic()
        return self._consume(received, failure or refusal, now - sending, now - started)

    def _consume(self, received, failure, seconds, waited, prefetched=False):
        """A step's envelope as every rank takes it: the leader's draws and counters (a
        prefetched step's counters follow from its outcome, as the leader's own loop counts
        them), then its error or its batch."""
        error = received["error"]
        if prefetched:
            self._passes.took_prefetched(error is None or error["code"] != "loader")
        elif not self.is_leader:
            self.epoch, self.step = received["epoch"], received["step"]
        if not self.is_leader:
            # Before anything can fail: the leader's draws, whatever the step's outcome (a fetch
            # that raised, a batch refused), so the mirror survives the error.
            self._calls.mirror(received["words"], self._leader)
        if error is not None:
            # A refused batch counted as a step (it is step `step`); a fetch that raised did not.
            doing = (f"sending step {self.step}" if error["code"] != "loader"
                     else f"fetching step {self.step + 1}")
            raise self._exchange.leader_failed(doing, error, failure)
        batch = self._exchange.batch(received, self.step)
        self._stats.count_step(received, batch, seconds, waited, self._summary)
        if self.is_leader:
            self._fetch_ahead.step_taken(received["done"], self._closed,
                                         save_hook(self.loader, self.state_hooks))
        return received["done"], batch

    def _summary(self):
        return self._stats.summary(self.stats())

    def _where(self):
        # Global ranks, as the rest of spbcast names them (and torch.distributed's src=); the
        # position in the SP group after it.
        return f"spbcast: rank {self.rank} (LeaderLoader, SP rank {self.sp_rank})"
