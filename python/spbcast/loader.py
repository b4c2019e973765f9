"""LeaderLoader: only the SP leader runs the data loader; every rank of the SP group gets its
batches, and every follower's default CPU generator advances as if it had run its own loader.

The Python counterpart of include/spbcast/loader.hpp. Each step the leader broadcasts one
envelope - status, epoch, step, how far its loader advanced the default generator, the batch -
over the SP group. The advance is *observed*, not predicted: the leader compares the default
CPU generator's state around every call into its loader (iterator creation, each next) and
counts the 32-bit words of the Mersenne Twister consumed in between, so whatever runs in the
main process - the DataLoader's base seed at each iterator creation (none when persistent
workers are reused), a RandomSampler's seed per epoch, a torch.rand in a dataset read with
num_workers=0 - followers consume exactly as many words of their own generator. What is not a
plain advance (a reseed, a cached normal sample) is refused on every rank.

Epochs follow the host trainer's numbering (first_epoch, set_epoch=), and the loader's own
checkpoint API is used whatever it is called (state_dict / get_state_dict / load_state_dict,
or hooks). The trainer's set_epoch is deferred to the leader's next fetch, inside the step: a
slow one is covered by keep-alive frames, a failing one reaches every SP rank, and the generator
words it draws travel with that step. load_state_dict is a collective of its own: the leader
restores its loader at once and every SP rank raises what that raised, as in BASE; its words
travel with the next step.
"""

import concurrent.futures
import contextlib
import collections
import dataclasses
import functools
import logging
import os
import queue
import time
import warnings

import torch
import torch.distributed as dist
import torch.utils.data.distributed

from ._broadcast import (_TRANSPORTS, _group_and_root, _group_timeout, _keep_alive, _relay_chunk_bytes,
                         _relay_hosts, _same_host_path, _seconds, broadcast)
from . import _prefetch
from ._shared_memory import shared_memory
from ._wire import decode_body
from .errors import Error, LoaderError, RemoteError, ResumeWarning, TransportError, loader_error, type_name

_MT_N = 624  # words per Mersenne Twister block
# The largest advance one loader call may make (64 Mi words: 256 MiB of random floats). An
# advance is counted by stepping a copy of the generator, which costs about as much as drawing
# the words did, and a change no advance explains is only known once the search passed this
# bound: it bounds what a cached normal sample or a reseed with the same seed costs before it
# is refused (another seed is seen at once: the state's initial seed changed).
_MAX_WORDS_PER_CALL = 1 << 26
_REPLAY_CHUNK = 1 << 20
_DEFAULT_TIMEOUT = 300.0  # seconds: the core's options.timeout, which timeout=None keeps
# 2 added the pass index and the last set_epoch value; 3 the pass's generators; 4 whether the
# pass reset persistent workers, whether the next one will, and the loader's own generators now.
_STATE_VERSION = 4
# The samplers whose pass order depends only on the generators a pass starts from (captured in
# the state) and the epoch given to set_epoch: a DataLoader with one of these resumes exactly
# without state of its own.
_REPLAYABLE_SAMPLERS = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler,
                        torch.utils.data.SubsetRandomSampler, torch.utils.data.WeightedRandomSampler,
                        torch.utils.data.distributed.DistributedSampler)
_END = object()


def _persistent_iterator(loader):
    """The iterator a DataLoader with persistent workers keeps between passes, or None. Its next
    iter() resets it: the workers go on, seeded as they were, and no base seed is drawn. The one
    place spbcast reads it: torch-internal ``DataLoader._iterator`` (torch 1.7 on; checked on
    torch 2.9 and 2.13); where a torch has none, resuming such a loader warns."""
    if isinstance(loader, torch.utils.data.DataLoader) and loader.persistent_workers and loader.num_workers > 0:
        return getattr(loader, "_iterator", None)
    return None


def _sampler_of(loader):
    """What orders a DataLoader's pass: its batch sampler's sampler, or a batch sampler of the
    program's own."""
    if type(loader.batch_sampler) is torch.utils.data.BatchSampler:
        return loader.batch_sampler.sampler
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def _keeps_workers(loader):
    return (isinstance(loader, torch.utils.data.DataLoader) and loader.persistent_workers
            and loader.num_workers > 0 and hasattr(loader, "_iterator"))


def _advance(generator, words):
    """Consumes `words` 32-bit words of `generator` (None: the default CPU generator)."""
    while words > 0:
        n = min(words, _REPLAY_CHUNK)
        torch.empty(n, dtype=torch.int32).random_(generator=generator)  # one word an element
        words -= n


def _next_index(state):
    # CPUGeneratorImpl's serialized state (THGeneratorState, unchanged since LibTorch 1.x):
    # u64 initial seed, i32 left, i32 seeded, u64 next (the position in the block), ...
    return int.from_bytes(state[16:24].numpy().tobytes(), "little")


def _layout_known():
    """Whether _next_index reads this torch's state layout (checked once, on a scratch one)."""
    global _LAYOUT_KNOWN
    if _LAYOUT_KNOWN is None:
        g = torch.Generator().manual_seed(12345)
        before = g.get_state()
        _advance(g, 700)
        after = g.get_state()
        _LAYOUT_KNOWN = (before.numel() >= 24 + 8 * _MT_N and
                         (_next_index(after) - _next_index(before)) % _MT_N == 700 % _MT_N)
    return _LAYOUT_KNOWN


_LAYOUT_KNOWN = None


def _initial_seed(state):
    return state[0:8].numpy().tobytes()


def _count_words(before, after):
    """How many 32-bit words take the default CPU generator's state from before to after, or
    None when no advance of at most _MAX_WORDS_PER_CALL words does."""
    if torch.equal(before, after):
        return 0
    if _layout_known() and _initial_seed(before) != _initial_seed(after):
        return None  # reseeded (manual_seed with another seed): no advance explains it
    g = torch.Generator()
    g.set_state(before)
    if _layout_known():
        # The position in the block fixes the count modulo one block; try block by block.
        total = (_next_index(after) - _next_index(before)) % _MT_N
        _advance(g, total)
        step = _MT_N
    else:
        total, step = 0, 1
    while total <= _MAX_WORDS_PER_CALL:
        if torch.equal(g.get_state(), after):
            return total
        _advance(g, step)
        total += step
        if step == 1 and total > 4 * _MT_N:  # without the layout, only short advances
            break
    return None


def _describe(error):
    """An exception as the leader sends it - data, never the exception object: spbcast's code
    for it (``loader`` for the loader's own exception), the type and message of the loader's
    exception, and the text every rank's message ends with."""
    if isinstance(error, LoaderError):
        return {"code": error.code, "type": error.original_type,
                "original": _text(error.original_message), "text": _text(error)}
    if isinstance(error, Error):
        return {"code": error.code, "type": type_name(type(error)), "original": _text(error),
                "text": _text(error)}
    name = type_name(type(error))
    return {"code": "loader", "type": name, "original": _text(error), "text": f"{name}: {_text(error)}"}


def _text(value):
    """str(value) as a plain str: an exception's message may be a str subclass (a DataLoader
    worker's KeyError carries torch's KeyErrorMessage), which spbcast would refuse to send."""
    return str.__str__(str(value))


def _tensor_bytes(value, seen=None):
    """The bytes of the distinct tensor storages in a batch (as spbcast sends each once)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_tensor_bytes(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return 0


def _warn_of_resume(message):
    if message is not None:
        warnings.warn(message, ResumeWarning, stacklevel=3)


def _is_description(error):
    return error is None or (type(error) is dict and set(error) == {"code", "type", "original", "text"}
                             and all(type(v) is str for v in error.values()))


def _receive_step(group, leader, options, name):
    """A follower's side of LeaderLoader._send_step: the envelope in wire form, and the leader's
    refusal (a RemoteError) when its batch was refused and the batch-less envelope followed."""
    try:
        return broadcast(None, group, leader, _name=name, _decode=False, **options), None
    except TransportError:
        raise
    except RemoteError as refused:  # the leader refused its batch; its step follows
        return broadcast(None, group, leader, _name=name + " (refused)", _decode=False, **options), refused


def _follow(channel, leader, options, received):
    """A follower's prefetch thread: receives the leader's envelopes on the channel, in order,
    into ``received`` - until the end of the data (or of the pass), the leader's close, or an
    error, which is put there too for the trainer's thread to raise at its step."""
    while True:
        started = time.monotonic()
        try:
            envelope, refused = _receive_step(channel, leader, options, "the next step")
        except BaseException as e:  # noqa: BLE001 - raised at the step that waits for it
            received.put(e)
            return
        received.put((envelope, refused, time.monotonic() - started))
        if type(envelope) is not dict or envelope.get("done") is not False or envelope.get("kind") == "stop":
            return


class _Steps:
    """A LeaderLoader's iterator. An error (a fetch that raised, a batch refused) does not end
    it, as it does not end a DataLoader's: a trainer that catches it calls next() again."""

    def __init__(self, loader):
        self._loader, self._done = loader, False

    def __iter__(self):
        return self

    def __next__(self):
        if self._done:
            raise StopIteration
        try:
            done, batch = self._loader._next()
        except BaseException:
            self._loader._mid_pass = True
            raise
        self._loader._mid_pass = not done
        if done:
            self._done = True
            self._loader._exhausted = not self._loader.per_pass
            raise StopIteration
        return batch


class LeaderLoader:
    """Iterates the batches of a data loader on every rank of ``sp_group``, loading them on the
    SP leader only: ``total_epoch`` passes or ``total_step`` steps, or - with ``set_epoch=None``
    - one pass per ``iter()``, as the loader itself, for a host trainer that drives the epochs.

    make_loader: a callable returning an iterable loader (e.g. a torch.utils.data.DataLoader);
        with ``sp_media_dedup`` on it is called on the SP leader (group rank 0) only. With
        ``build_on_every_rank`` it is called with that callable's result.
    sp_group: the SP process group (None: the default group).
    sp_media_dedup: off means every rank runs its own loader (BASE), as without spbcast.
    build_on_every_rank: a callable run on every SP rank before the loader is built (datasets
        whose construction is collective, or that every rank needs anyway); its result is
        passed to ``make_loader``, which runs on the leader only. Its generator draws happen on
        every rank, as in BASE, so they need no mirroring.
    first_epoch: the number of the first pass (the ``epoch`` attribute during it); 0 by default,
        1 for a trainer that counts epochs from 1 (XTuner).
    set_epoch: how the loader's ``set_epoch`` is driven:
        "auto" (default): before each pass after the first, ``set_epoch(first_epoch + pass)``
            - set_epoch(1), (2), ... by default; set_epoch(2), (3), ... with first_epoch=1, as
            XTuner's trainer calls it.
        a callable: ``set_epoch(pass_index)`` (0 for the first pass) gives the value for the
            loader's set_epoch before each pass, including the first, or None to call nothing.
        None: the host trainer drives the epochs, as it does with its own loader: each ``iter()``
            is one pass, ``len()`` the loader's length, total_epoch and total_step stay unset,
            and the trainer's ``loader.set_epoch(e)`` reaches the leader's loader.
    state_hooks: ``(save, load)`` to checkpoint the loader: ``save(loader, *args, **kwargs)``
        returns its state, ``load(loader, state)`` restores it. By default the loader's own
        ``state_dict()`` or ``get_state_dict()`` (XTuner's Dataloader) and ``load_state_dict()``.
    tp_size: dedup requires tensor parallelism 1.
    timeout: seconds (or a timedelta) bounding the transport of each step's broadcast (default
        5 minutes). A leader that takes longer to build its loader or fetch a batch is not a
        failure: meanwhile it sends keep-alive frames every timeout / 4, and the followers wait
        for it as a BASE rank waits for its own loader.
    root_wait: seconds (or a timedelta) a step's first message may wait: a follower for a leader
        that is late outside the loader (saving a checkpoint, an after-save hook on rank 0), and the
        leader for a follower late the same way (writing its checkpoint shard, an evaluation).
        None (default): the SP group's own timeout (``init_process_group``'s or ``new_group``'s
        ``timeout=``, 30 minutes by default for Gloo), exactly as long as a BASE rank would wait
        for that peer in the trainer's next collective on the group, shorter or longer than
        ``timeout``; spbcast's own wait ends at most 2 s after it. The leader's keep-alive frames
        come every quarter of the shorter of this and ``timeout``. A dead peer is an error at once.
    transport: how batches travel, as in ``spbcast.broadcast``: "auto" (the same-host path where
        the SP group shares a host, the hierarchical path where it spans hosts), "network",
        "shared_memory" or "hierarchical".
    relay_chunk_bytes: the chunk in which the hierarchical path relays each batch from host
        leader to host leader, as in ``spbcast.broadcast``: a positive int; None: 4 MiB. The
        leader's value is used, clamped to 64 KiB .. 1 GiB.
    log_every, log: every ``log_every`` steps (0: never) and at the end of the data, a one-line
        summary of ``stats()`` goes to ``log`` (a callable taking the line; default: the
        ``spbcast`` logger of Python's logging, at INFO).
    leader_allocates_in_shared_memory: on the same-host path the leader fetches each batch inside
        ``spbcast.shared_memory()``, so the batch's large tensors are born in shared memory and
        the broadcast copies nothing. Off (or with transport "network", or where the group took
        the network path) batches are ordinary memory, copied by the broadcast.
    prefetch: how many steps the leader fetches and broadcasts ahead, while the trainer runs its
        step (on a thread of each rank and a Gloo group of the SP ranks of the loader's own, so
        never in the middle of the trainer's collectives on the SP group). None (default): 1
        where that keeps every rank's batches and generators BASE's - a torch DataLoader with
        worker processes and one of torch's samplers (its fetch draws nothing from the default
        CPU generator in this process), its own state, if any, torchdata's - and 0 (each batch
        fetched and sent when next() asks for it) elsewhere; ``prefetch_reason`` says which. An
        int: that depth; the caller vouches that the loader's fetch draws nothing from the
        default CPU generator in this process. What BASE does on the trainer's thread stays
        there: a pass starts (its iterator, its base seed, set_epoch) when next() asks for its
        first batch; state_dict() is the state after the last batch taken, not the prefetched
        ones; an error of a prefetched fetch is raised at its own step.

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
        # Checked on every rank before any collective, so a bad configuration is one clear error
        # everywhere rather than a rank stuck in a collective.
        rank = dist.get_rank() if dist.is_initialized() else 0
        where = f"spbcast: rank {rank}: invalid LeaderLoader configuration: "
        if set_epoch is None:
            if total_epoch is not None or total_step is not None:
                raise Error(where + "with set_epoch=None the host trainer drives the passes (each "
                            "iter() is one pass of the loader): leave total_epoch and total_step "
                            "unset", "invalid_argument")
        elif (total_epoch is None) == (total_step is None):
            raise Error(where + "set exactly one of total_epoch and total_step "
                        f"(both are {'set' if total_epoch is not None else 'unset'}), or "
                        "set_epoch=None for one pass per iter()", "invalid_argument")
        for name, v in (("total_epoch", total_epoch), ("total_step", total_step)):
            if v is not None and (type(v) is not int or v <= 0):
                raise Error(where + f"{name} must be a positive int (got {v!r})", "invalid_argument")
        if type(first_epoch) is not int:
            raise Error(where + f"first_epoch must be an int (got {first_epoch!r})", "invalid_argument")
        if not (set_epoch is None or set_epoch == "auto" or callable(set_epoch)):
            raise Error(where + "set_epoch must be \"auto\", None (the trainer calls set_epoch) or "
                        f"a callable mapping the pass index to the epoch (got {set_epoch!r})",
                        "invalid_argument")
        if state_hooks is not None and not (isinstance(state_hooks, (tuple, list))
                                            and len(state_hooks) == 2
                                            and all(callable(h) for h in state_hooks)):
            raise Error(where + "state_hooks must be a pair of callables (save(loader) -> state, "
                        f"load(loader, state)) (got {state_hooks!r})", "invalid_argument")
        if type(tp_size) is not int or tp_size < 1:
            raise Error(where + f"tp_size must be an int of at least 1 (got {tp_size!r})",
                        "invalid_argument")
        if sp_media_dedup and tp_size > 1:
            raise Error(where + f"sp_media_dedup requires TP size 1 (got {tp_size}); turn "
                        "sp_media_dedup off or run with tensor parallelism 1", "invalid_argument")
        if not callable(make_loader):
            raise Error(where + "make_loader must be a callable that returns the loader",
                        "invalid_argument")
        if build_on_every_rank is not None and not callable(build_on_every_rank):
            raise Error(where + "build_on_every_rank must be a callable (its result is passed to "
                        "make_loader)", "invalid_argument")
        if transport not in _TRANSPORTS:
            raise Error(where + "transport must be 'auto', 'network', 'shared_memory' or 'hierarchical' "
                        f"(got {transport!r})", "invalid_argument")
        _seconds(timeout)  # refused here, on every rank, rather than in the first broadcast
        _seconds(root_wait, "root_wait")
        _relay_chunk_bytes(relay_chunk_bytes, where)
        if prefetch is not None and (type(prefetch) is not int or prefetch < 0):
            raise Error(where + f"prefetch must be None (where it keeps every rank's batches and "
                        f"generators BASE's) or an int of at least 0 (got {prefetch!r})",
                        "invalid_argument")

        self.total_epoch = total_epoch
        self.total_step = total_step
        self.first_epoch = first_epoch
        self.per_pass = set_epoch is None
        if set_epoch == "auto":
            self._epoch_for_pass = lambda i: None if i == 0 else first_epoch + i
        else:
            self._epoch_for_pass = set_epoch  # None: the trainer calls set_epoch
        self.state_hooks = state_hooks
        self.timeout = timeout
        self.transport = transport
        self.relay_chunk_bytes = relay_chunk_bytes
        self.leader_allocates_in_shared_memory = bool(leader_allocates_in_shared_memory)
        if type(log_every) is not int or log_every < 0:
            raise Error(where + f"log_every must be an int of at least 0 (got {log_every!r})",
                        "invalid_argument")
        self.log_every = log_every
        self._log = log if log is not None else logging.getLogger("spbcast").info
        self._stats = {"steps": 0, "bytes": 0, "loader_seconds": 0.0, "broadcast_seconds": 0.0,
                       "leader_loader_seconds": 0.0, "wait_seconds": 0.0, "prefetch_hits": 0}
        self.epoch = first_epoch
        self.step = 0
        self._pass = 0  # passes completed
        self._in_epoch = 0
        self._epoch_value = None  # the last value given to the loader's set_epoch
        self._skip = 0  # batches to drop when resuming mid-epoch without loader state
        self._pass_generators = None  # the generators' states when the current pass began
        self._pass_resets_workers = False  # the pass's iter() reset persistent workers (no base seed)
        # Resuming a run whose next pass resets persistent workers: start them first (see
        # _start_persistent_workers).
        self._start_workers_first = False
        self._fetches_in_pass = 0  # next() calls on the pass's iterator, those that raised included
        self._replay_from = None  # resuming: the saved pass's generators, to replay it from
        # A step of the pass was taken and its end was not: the same on every SP rank (followers
        # hold no iterator), so a new iter() drops what was prefetched on all of them alike.
        self._mid_pass = False
        self._end_of_epoch_pending = False  # resumed at an epoch's end through the loader's state
        self._finished = False
        self._exhausted = False  # the whole run was iterated (the loader drives the epochs)
        self._closed = False
        self._iter = None
        # The dedup leader's calls into its loader made outside a step, run at its next fetch,
        # and the generator words drawn outside a step, sent with the next one.
        self._pending = []
        self._carried_words = 0
        self.loader = None
        self.length = -1
        # Prefetch (see "prefetch" below): the depth in use and why, the channel and thread, the
        # leader's submitted steps, a follower's received ones.
        self.prefetch, self.prefetch_reason = 0, "sp_media_dedup is off"
        self._prefetch_state = None
        self._channel = self._prefetcher = None
        self._in_flight = collections.deque()
        # Set on the prefetch thread: the pass's iterator is exhausted. The trainer's thread reads
        # it once every job is done (after the marker that said so was taken).
        self._pass_ended = False
        self._listening = False  # the leader: its followers' threads are receiving envelopes
        self._following = None  # a follower: the job receiving envelopes, while it runs
        self._received = queue.Queue()
        self._discarding = False  # a follower: skip prefetched envelopes until a synchronous one
        self._pid = os.getpid()

        if sp_media_dedup and not dist.is_initialized():
            raise Error(where + "sp_media_dedup needs torch.distributed to be initialized",
                        "invalid_argument")
        self.group = sp_group if sp_group is not None else (dist.group.WORLD if dist.is_initialized() else None)
        self.rank = rank  # global, as every spbcast message names ranks
        self.sp_rank = dist.get_rank(self.group) if self.group is not None else 0
        sp_size = dist.get_world_size(self.group) if self.group is not None else 1
        self.dedup = bool(sp_media_dedup) and sp_size > 1
        self._leader = dist.get_global_rank(self.group, 0) if self.dedup else rank
        # A step's first message waits for a late peer as long as the group's own collectives
        # would (as C++ loader_config::root_wait).
        self.root_wait = None
        if self.dedup:
            self.root_wait = _seconds(root_wait, "root_wait") or _group_timeout(self.group)
        # Every rank: what BASE builds on every rank too (its draws need no mirroring).
        if build_on_every_rank is not None:
            shared = build_on_every_rank()
            make = lambda: make_loader(shared)  # noqa: E731
        else:
            make = make_loader
        if not self.dedup:
            self.loader = make()
            self.length = self._local_length()
            self._start_pass(None)
            return
        # The group is checked on every rank (a CPU backend, ...) before the leader's keep-alive
        # would use it alone.
        _group_and_root(self.group, self._leader)

        init = {"error": None, "words": 0, "length": -1, "prefetch": 0, "prefetch_reason": ""}
        failure = None  # the leader's own exception, the cause of what every rank raises
        if self.is_leader:
            try:
                with self._still_working():  # building a loader may take longer than timeout
                    before = torch.get_rng_state()
                    self.loader = make()
                    init["words"] = self._words(before, "building the loader")
                    init["length"] = self._local_length()
                    words = [0]
                    self._start_pass(words)
                    init["words"] += words[0]
                    init["prefetch"], init["prefetch_reason"], self._prefetch_state = \
                        self._prefetch_policy(prefetch)
            except Exception as e:  # noqa: BLE001 - sent to the followers, re-raised below
                failure = e
                init["error"] = _describe(e)
        init = broadcast(init, self.group, self._leader, _name="loader_init", **self._broadcast_options())
        if init["error"] is not None:
            raise self._leader_failed("building the data loader", init["error"], failure)
        if not self.is_leader:
            self._replay(init["words"])
        self.length = init["length"]
        self.prefetch, self.prefetch_reason = init["prefetch"], init["prefetch_reason"]
        if self.prefetch:
            # Every SP rank, at the same point: the channel is a group of the SP ranks.
            self._channel = _prefetch.channel(self.group, self.root_wait)
            self._prefetcher = _prefetch.Prefetcher(f"spbcast prefetch (rank {rank})")
            _prefetch.close_at_exit(self)

    # ---- public -------------------------------------------------------------------------------

    @property
    def is_leader(self):
        return self.sp_rank == 0

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
        if self._exhausted:
            raise Error(self._where() + ": this LeaderLoader has run all its "
                        + (f"{self.total_epoch} epochs" if self.total_epoch is not None else
                           f"{self.total_step} steps")
                        + " (it drives the epochs itself: one iteration is the whole run); make a new "
                        "one, or pass set_epoch=None for one pass per iter() as a DataLoader",
                        "invalid_argument")
        if self.per_pass:
            # One pass per iter(), as the loader's own: a new iter() starts a new pass, except
            # the first after load_state_dict, which continues where the state was taken.
            if self._mid_pass:
                self._drop_prefetched()
                self._iter, self._in_epoch, self._skip = None, 0, 0
            self._finished = False
        return _Steps(self)

    def set_epoch(self, epoch):
        """The host trainer's set_epoch: the epoch of the next pass (and the ``epoch`` attribute).
        Call it on every SP rank, as on the loader itself. It reaches the loader (or its sampler)
        on the leader - on the dedup leader at its next fetch, inside the step, so a slow
        set_epoch is covered by keep-alive frames and the generator words it draws reach the
        followers with that step - and nothing on the followers."""
        if not self.per_pass:
            raise Error(self._where() + f": set_epoch({epoch!r}) on a LeaderLoader that drives the "
                        "epochs itself (total_epoch / total_step): it calls the loader's set_epoch "
                        "as set_epoch= says; pass set_epoch=None to drive the epochs from the trainer",
                        "invalid_argument")
        self.epoch = epoch
        if self.loader is not None:
            self._leader_work(f"calling the loader's set_epoch({epoch!r})",
                              lambda words: self._set_epoch(epoch, words))

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
        self._close_prefetch()
        # torch-internal, named here only: a DataLoader iterator's _shutdown_workers() and the
        # DataLoader's _iterator (its persistent workers' iterator). Where a torch has neither,
        # dropping the references below ends the workers when the iterator is collected.
        for it in (self._iter, _persistent_iterator(self.loader)):
            shutdown = getattr(it, "_shutdown_workers", None)
            if callable(shutdown):
                shutdown()
        self._iter = self.loader = None
        self._pending = []

    def __enter__(self):
        return self

    def __del__(self):
        # Collected at any time, on each rank at its own: no message to the peers, and the
        # channel stays (destroying it here would change the names of the next groups made on
        # this rank and not on its peers): only the prefetch thread ends, once its jobs are done.
        prefetcher = getattr(self, "_prefetcher", None)
        if prefetcher is not None and prefetcher.usable():
            prefetcher.stop(0)

    def __exit__(self, *exc):
        self.close()

    def state_dict(self):
        """The loop position and the loader's own state (state_dict(), get_state_dict() or the
        save hook); empty on dedup followers, which hold no loader and call nothing. Save the SP
        leader's."""
        return self.get_state_dict()

    def get_state_dict(self, *args, **kwargs):
        """state_dict() under the name XTuner's Dataloader uses; the arguments go to the loader's
        own state call. Where that call is a collective over the loader's DP group, the leaders
        of all DP replicas call it together (followers return {} and call nothing)."""
        if self.loader is None:
            return {}
        self._settle()  # the prefetched fetches are done: the loader is not in use
        self._run_pending_outside_step()
        state = {"version": _STATE_VERSION, "epoch": self.epoch, "pass": self._pass,
                 "step": self.step, "in_epoch": self._in_epoch, "epoch_value": self._epoch_value,
                 "loader": None}
        save = self._save_hook()
        if save is not None:
            state["loader"] = self._loader_state(save, args, kwargs)
        else:  # what the pass's order came from, and how far it went, to replay it on resume
            self._finish_pass_iterator()
            state["pass_generators"] = self._pass_generators
            state["fetches_in_pass"] = self._fetches_in_pass
            state["pass_resets_workers"] = self._pass_resets_workers
            state["next_pass_resets_workers"] = (_persistent_iterator(self.loader) is not None
                                                 or self._start_workers_first)
            # Where the next pass starts from: the default generator is the trainer's to save.
            state["generators"] = {name: value for name, value in self._generator_states().items()
                                   if name != "default"}
        return state

    def _finish_pass_iterator(self):
        """Saved after an epoch's last batch, the resumed run starts the next pass from the
        loader's generators as they are now - but a sampler may still draw when its iterator is
        exhausted (RandomSampler draws once more past its last index), which the continuous
        run's next fetch does. So that fetch is made now, where it cannot yield a batch (one of
        torch's samplers over a map-style dataset: len() is exact), and the next fetch ends the
        pass without another."""
        if (self._iter is not None and not self.per_pass and 0 < self.length <= self._in_epoch
                and not self._pass_ended and self._replay_is_exact()):
            batch = self._outside_step("ending the pass", lambda: next(self._iter, _END))
            if batch is not _END:
                raise Error(self._where() + f": the DataLoader yielded a batch past its len() "
                            f"({self.length}) in epoch {self.epoch}; spbcast cannot save its "
                            "position (its sampler's len() must be its number of indices)", "loader")
            self._pass_ended = True

    def _loader_state(self, save, args, kwargs):
        """The loader's own state as of the last step taken: with batches prefetched, taken back
        by them (see _prefetch_policy)."""
        outcomes = [job.result() for job in self._in_flight]
        if not outcomes:
            return self._outside_step("taking the loader's state", lambda: save(*args, **kwargs))
        if self._prefetch_state == "rewind":
            batches = [o["batch"] for o in outcomes if o["batch"] is not None]
            with self._rewound(batches):
                state = self._outside_step("taking the loader's state", lambda: save(*args, **kwargs))
        elif args or kwargs:
            raise Error(self._where() + ": the loader's state was asked for with arguments while "
                        "batches are prefetched; spbcast took it before the first of them without "
                        "arguments: call get_state_dict() without them, or pass prefetch=0",
                        "invalid_argument")
        else:
            state = outcomes[0]["snapshot"]
            if isinstance(state, BaseException):
                raise loader_error(self._where() + f": taking the loader's state raised "
                                   f"{type_name(type(state))}: {state}", type_name(type(state)),
                                   str(state), type(state)) from state
        if self._carried_words:
            raise Error(self._where() + f": the loader's calls outside the steps drew "
                        f"{self._carried_words} words from the default CPU generator while batches "
                        "were prefetched: the followers cannot mirror them at their step; pass "
                        "prefetch=0 for this loader", "loader")
        return state

    def load_state_dict(self, state):
        """Continues exactly where state_dict() was taken, from the next batch. The last epoch
        given to the loader's set_epoch is given again, then the loader's own state restored. A
        loader without state of its own is fast-forwarded: the resumed epoch is started again from
        the generators it began with and its first batches are loaded and dropped - exact for a
        DataLoader with one of torch's samplers; for any other loader it warns (ResumeWarning),
        on every SP rank, as its order may depend on what spbcast cannot restore.

        Under dedup, call it on every SP rank (as a trainer calls its loader's): it is a
        collective over the SP group. The leader checks the state and restores its loader at
        once; followers ignore the state they are given (None will do) and raise what the
        leader's load raised - a state the leader cannot load is an error on every SP rank, here,
        not at the first fetch."""
        self._mid_pass = False  # the first iter() after it continues where the state was taken
        if not self.dedup:
            _warn_of_resume(self._load(state))
            return
        self._drop_prefetched()
        outcome, failure = {"error": None, "warning": None}, None
        if self.is_leader:
            try:
                outcome["warning"] = self._load(state)
                self._run_pending_outside_step()  # now: what it raises is load_state_dict's
            except Exception as e:  # noqa: BLE001 - sent to the followers, re-raised below
                failure = e
                outcome["error"] = _describe(e)
        outcome = broadcast(outcome, self.group, self._leader, _name="load_state_dict",
                            **self._broadcast_options())
        if not (type(outcome) is dict and set(outcome) == {"error", "warning"}
                and _is_description(outcome["error"]) and type(outcome["warning"]) in (str, type(None))):
            raise Error(self._where() + f": the SP leader (rank {self._leader}) sent a load_state_dict "
                        "outcome that is not LeaderLoader's (is the same spbcast installed on every "
                        "rank?)", "corrupt_frame")
        if outcome["error"] is None:
            _warn_of_resume(outcome["warning"])
            return
        if isinstance(failure, Error) and not isinstance(failure, LoaderError):
            raise failure  # the leader's own words about the state it was given
        raise self._leader_failed("loading its state", outcome["error"], failure)

    def _load(self, state):
        if not isinstance(state, dict) or state.get("version") not in (1, 2, 3, _STATE_VERSION):
            raise Error(self._where() + ": load_state_dict got a state that LeaderLoader."
                        "state_dict did not write; pass the SP leader's state_dict()",
                        "invalid_argument")
        self.epoch, self.step, self._in_epoch = state["epoch"], state["step"], state["in_epoch"]
        if state["version"] == 1:  # epochs counted from 0, set_epoch(epoch) from the second on
            self._pass = self.epoch
            self._epoch_value = self.epoch or None
        else:
            self._pass, self._epoch_value = state["pass"], state["epoch_value"]
        self._iter = None
        self._finished = self._exhausted = False
        self._pass_generators = state.get("pass_generators")
        self._fetches_in_pass = state.get("fetches_in_pass", self._in_epoch)
        self._end_of_epoch_pending = False
        self._skip = 0
        load = self._load_hook()
        own_state = state["loader"] is not None and load is not None
        # Where spbcast drove set_epoch, giving the last value again is its part of the resume
        # (the loader's own state may not hold the epoch); where the trainer drives it, the
        # trainer's resume does that, so only the drop-based fast-forward needs it.
        reapply = self._epoch_value is not None and (not self.per_pass or not own_state)
        value = self._epoch_value

        # Resumed where a pass starts (before the first step, after an epoch's last batch), the
        # next pass starts from the loader's generators as the continuous run has them now; resumed
        # mid-pass, the replay sets them to where the pass began.
        at_pass_start = self._in_epoch == 0 or (not self.per_pass and 0 < self.length <= self._in_epoch)
        next_pass_generators = state.get("generators", {}) if at_pass_start and not own_state else {}
        resets_workers = not own_state and state.get(
            "next_pass_resets_workers" if at_pass_start else "pass_resets_workers", False)
        self._start_workers_first = resets_workers and _keeps_workers(self.loader)

        def restore(words):
            if reapply:
                self._set_epoch(value, words)
            if own_state:
                self._counted(words, "restoring the loader's state", load, state["loader"])
            self._set_generators(next_pass_generators)

        self._leader_work("load_state_dict", restore)
        warnings_ = []
        if not self.per_pass and self.length > 0 and self._in_epoch >= self.length:
            # Saved right after an epoch's last batch: the continuous run ends that pass at its
            # next fetch, so the resumed run starts the next epoch. A loader whose own state
            # knows that its epoch was consumed (torchdata's StatefulDataLoader) gives one empty
            # iterator first, the end of that epoch: it is not a pass of its own.
            self._leader_work("starting the next epoch", self._end_pass)
            self._end_of_epoch_pending = own_state
        elif not own_state:
            self._skip = self._in_epoch
            generators = state.get("pass_generators")
            if self._skip > 0 and generators is not None and self._replay_is_exact():
                self._replay_from = generators
                self._skip = state.get("fetches_in_pass", self._skip)
            elif self._skip > 0:
                warnings_.append(
                    f"resuming mid-epoch (step {self._in_epoch} of epoch {self.epoch}) by dropping "
                    f"the epoch's first {self._skip} batches, which gives the continuous run's "
                    "batches only if the loader's order depends on nothing but the epoch given to "
                    "set_epoch: "
                    + ("the state holds no generators of the pass (written by an older spbcast)"
                       if generators is None else
                       f"{type(self.loader).__name__} is not a DataLoader with one of torch's "
                       "samplers, whose pass spbcast replays from its generators")
                    + "; give the loader state of its own (state_dict / load_state_dict, "
                    "torchdata's StatefulDataLoader) or state_hooks=, or silence "
                    "spbcast.ResumeWarning if the order is the epoch's alone")
        # The epoch the resumed run goes on in (after an epoch's last batch: the next one).
        resumed_epoch, resumed_pass = (self.epoch + 1, self._pass + 1) if self._in_epoch and at_pass_start \
            else (self.epoch, self._pass)
        if not own_state and at_pass_start and resumed_pass > 0 and self._own_sampler() is not None:
            warnings_.append(
                f"resuming at the start of epoch {resumed_epoch}: the sampler "
                f"{type(self._own_sampler()).__name__} is not one of torch's, and what it carries "
                "from one pass to the next (its own generators, Python's or numpy's) is not "
                "restored; give the loader state of its own (state_dict / load_state_dict, "
                "torchdata's StatefulDataLoader) or state_hooks=, or silence "
                "spbcast.ResumeWarning if its order is the epoch's alone")
        if resets_workers:
            warnings_.append(
                f"resuming epoch {resumed_epoch} of a DataLoader with persistent workers "
                "(persistent_workers=True), which the continuous run started in an earlier pass: "
                "the resumed run starts them anew, so what they draw (augmentation with torch's, "
                "Python's or numpy's generators in the dataset or collate_fn) is not the "
                "continuous run's - their generators carried over from the earlier passes"
                + ("" if self._start_workers_first else
                   ", and nor may the sample order be (this torch's DataLoader keeps no "
                   "persistent iterator where spbcast looks: DataLoader._iterator)")
                + "; for exact worker-side randomness use torchdata's StatefulDataLoader (it "
                "snapshots its workers) or persistent_workers=False, or silence "
                "spbcast.ResumeWarning if the workers draw nothing")
        return "; and ".join(self._where() + ": " + w for w in warnings_) or None

    # ---- steps ----------------------------------------------------------------------------------

    def _next(self):
        if not self.dedup:
            started = time.monotonic()
            batch = self._fetch(None)
            received = {"done": batch is _END, "seconds": time.monotonic() - started}
            self._count_step(received, batch, 0.0, time.monotonic() - started)
            return batch is _END, (None if batch is _END else batch)
        if self.prefetch:
            return self._next_prefetching()
        started = time.monotonic()
        envelope, failure = self._leader_step() if self.is_leader else (None, None)
        sending = time.monotonic()
        received, refusal = self._send_step(envelope, self.group)
        now = time.monotonic()
        return self._consume(received, failure or refusal, now - sending, now - started)

    def _leader_step(self):
        """The leader's envelope of a step fetched now, on the trainer's thread (the synchronous
        step), and its own exception if the fetch raised."""
        envelope = {"error": None, "epoch": 0, "step": 0, "words": 0, "done": False, "batch": None,
                    "seconds": 0.0, "kind": "step"}
        failure = None
        started = time.monotonic()
        words = [self._carried_words]
        self._carried_words = 0
        try:
            # While the leader fetches, the followers wait in the broadcast below: keep-alive
            # frames tell them it is still working. On the same-host path a batch collated on
            # this thread is born in shared memory, so the broadcast copies nothing.
            with self._still_working():
                self._run_pending(words)
                with self._fetching_in_shared_memory():
                    batch = self._fetch(words)
            envelope["done"] = batch is _END
            envelope["batch"] = None if batch is _END else batch
        except Exception as e:  # noqa: BLE001 - sent to the followers, re-raised below
            failure = e
            envelope["error"] = _describe(e)
        envelope["words"] = words[0]
        envelope["epoch"], envelope["step"] = self.epoch, self.step
        envelope["seconds"] = time.monotonic() - started
        return envelope, failure

    def _consume(self, received, failure, seconds, waited, prefetched=False):
        """A step's envelope as every rank takes it: the leader's draws and counters (a
        prefetched step's counters follow from its outcome, as the leader's own loop counts
        them), then its error or its batch."""
        error = received["error"]
        if prefetched:
            # A batch, or a batch spbcast refused, is a step; a fetch that raised is not, but
            # it took its samples: the pass's fetch count (for a resume's replay) includes it.
            if error is None or error["code"] != "loader":
                self.step += 1
                self._in_epoch += 1
            self._fetches_in_pass += 1
        elif not self.is_leader:
            self.epoch, self.step = received["epoch"], received["step"]
        if not self.is_leader:
            # Before anything can fail: the leader's draws, whatever the step's outcome (a fetch
            # that raised, a batch refused), so the mirror survives the error.
            self._replay(received["words"])
        if error is not None:
            # A refused batch counted as a step (it is step `step`); a fetch that raised did not.
            doing = (f"sending step {self.step}" if error["code"] != "loader"
                     else f"fetching step {self.step + 1}")
            raise self._leader_failed(doing, error, failure)
        batch = received["batch"]
        if not self.is_leader and not received["done"]:
            batch = decode_body(batch, self.rank, f'step[{self.step}]["batch"]')
        self._count_step(received, batch, seconds, waited)
        if self.is_leader and received["done"]:
            self._listening = False  # the followers' threads stop at the end of the data
        elif self.is_leader:
            self._prefetch_more()
        return received["done"], batch

    # ---- prefetch -------------------------------------------------------------------------------
    #
    # With prefetch, every step's envelope travels on the loader's own channel (_prefetch.py), in
    # one order on every rank. The leader's trainer thread, after taking step t, submits the fetch
    # and broadcast of t + 1 .. t + depth to its prefetch thread; a follower's prefetch thread
    # receives envelopes one after another from its first next() until the end of the data.
    # What BASE does on the trainer's thread stays there, at BASE's step: starting a pass (the
    # iterator, its base seed, set_epoch), the trainer's calls between steps, resuming. A
    # prefetched fetch that finds its pass ended sends a "marker" (nothing for this step: the
    # leader's trainer thread sends it, synchronously); followers skip markers. Where the leader
    # drops what it prefetched (load_state_dict, a new iter() mid-pass) the next envelope it
    # sends is a synchronous one, and followers drop prefetched envelopes until they see it.

    def _next_prefetching(self):
        started = time.monotonic()
        if self.is_leader:
            self._listening = True
            while self._in_flight:
                job = self._in_flight.popleft()
                hit = job.done()
                outcome = job.result()  # waits without the GIL; raises the transport's error
                if outcome["kind"] == "marker":
                    self._settle()  # the jobs after it found the pass ended too
                    self._in_flight.clear()
                    break
                self._stats["prefetch_hits"] += hit
                return self._consume(outcome["received"], outcome["failure"], outcome["seconds"],
                                     time.monotonic() - started, prefetched=True)
            envelope, failure = self._leader_step()
            sending = time.monotonic()
            received, refusal = self._send_step(envelope, self._channel)
            now = time.monotonic()
            return self._consume(received, failure or refusal, now - sending, now - started)
        if self._following is None:
            self._following = self._prefetcher.submit(functools.partial(
                _follow, self._channel, self._leader, self._broadcast_options(), self._received))
        while True:
            hit = not self._received.empty()
            item = self._received.get()  # waits without the GIL
            if isinstance(item, BaseException):
                self._following = None
                raise item
            received, refusal, seconds = item
            received = self._checked_step(received)
            kind = received["kind"]
            if kind == "stop":
                self._following = None
                raise Error(self._where() + f": the SP leader (rank {self._leader}) closed its "
                            "LeaderLoader while this rank still iterates it: close it on every SP "
                            "rank at the same point", "out_of_step")
            if kind == "marker" or (self._discarding and kind == "prefetched"):
                continue
            self._discarding = False
            break
        if received["done"]:
            self._following = None
        self._stats["prefetch_hits"] += hit and kind == "prefetched"
        return self._consume(received, refusal, seconds, time.monotonic() - started,
                             prefetched=kind == "prefetched")

    def _prefetch_more(self):
        """On the leader, after a step: keep `prefetch` steps in flight while the pass goes on
        and nothing is due on the trainer's thread first."""
        while (len(self._in_flight) < self.prefetch and self._iter is not None
               and not (self._pass_ended or self._finished or self._closed
                        or self._pending or self._carried_words or self._skip
                        or self._replay_from is not None or self._end_of_epoch_pending)
               and (self.total_step is None or self.step + len(self._in_flight) < self.total_step)):
            save = self._save_hook() if self._prefetch_state == "snapshot" else None
            self._in_flight.append(self._prefetcher.submit(functools.partial(
                self._prefetched_step, self._iter, save, self.step + len(self._in_flight) + 1)))

    def _prefetched_step(self, iterator, save, step):
        """On the leader's prefetch thread: fetch the pass's next batch and broadcast it on the
        channel. Its draws from the default generator are not counted: prefetch runs only where
        the fetch draws none in this process (see _prefetch_policy)."""
        envelope = {"error": None, "epoch": -1, "step": -1, "words": 0, "done": False, "batch": None,
                    "seconds": 0.0, "kind": "prefetched"}
        outcome = {"failure": None, "snapshot": None, "batch": None}
        started = time.monotonic()
        try:
            with self._still_working():
                if save is not None:  # the loader's state before this fetch, for state_dict
                    try:
                        outcome["snapshot"] = save()
                    except Exception as e:  # noqa: BLE001 - raised by state_dict, if it is asked for
                        outcome["snapshot"] = e
                with self._fetching_in_shared_memory():
                    batch = _END if self._pass_ended else next(iterator, _END)
            if batch is _END:
                self._pass_ended = True
                envelope["kind"] = "marker"
            else:
                envelope["batch"] = outcome["batch"] = batch
        except Exception as e:  # noqa: BLE001 - raised at its step on every rank
            outcome["failure"] = e
            envelope["error"] = _describe(e)
        envelope["seconds"] = time.monotonic() - started
        sending = time.monotonic()
        received, refusal = self._send_step(envelope, self._channel, f"step[{step}]")
        outcome.update(kind=envelope["kind"], received=received, seconds=time.monotonic() - sending)
        outcome["failure"] = outcome["failure"] or refusal
        return outcome

    def _settle(self):
        """Waits until the leader's prefetch thread has run every job submitted (each sent its
        envelope), whatever their outcome; they stay to be taken."""
        concurrent.futures.wait(self._in_flight)

    def _drop_prefetched(self):
        """On every SP rank, at the same point: what was prefetched is not taken (a resume, a
        new pass mid-pass). The leader's next envelope is a synchronous step; the followers skip
        the prefetched ones before it."""
        if not self.prefetch:
            return
        if self.is_leader:
            self._settle()
            self._in_flight.clear()
        elif self._following is not None:
            self._discarding = True
        self._pass_ended = False

    def _prefetch_policy(self, requested):
        """On the leader: (depth, why, how the loader's own state is taken with batches in
        flight: None - it has none; "snapshot" - its save hook before each prefetched fetch;
        "rewind" - _rewound). By default prefetch only where it keeps every rank's batches and
        generators BASE's: a torch DataLoader whose fetch runs in worker processes and whose
        sampler is torch's own (it draws from the default generator only when a pass starts,
        on the trainer's thread), and whose own state, if any, is torchdata's."""
        own_state = self._save_hook() is not None
        stateful = type(self.loader).__module__.startswith("torchdata.stateful_dataloader")
        if requested is not None:
            return requested, "prefetch=" + str(requested), ("snapshot" if own_state else None)
        loader = self.loader
        if not isinstance(loader, torch.utils.data.DataLoader):
            return 0, (f"{type(loader).__name__} is not a torch DataLoader, so its fetch may draw "
                       "from the default CPU generator in this process (pass prefetch=1 if it "
                       "does not)"), None
        if loader.num_workers == 0:
            return 0, ("num_workers=0: the fetch runs in this process, where the dataset or the "
                       "collate function may draw from the default CPU generator (pass "
                       "prefetch=1 if they do not)"), None
        sampler = _sampler_of(loader)
        if not (isinstance(loader.dataset, torch.utils.data.IterableDataset)
                or type(sampler) in _REPLAYABLE_SAMPLERS):
            return 0, (f"the sampler {type(sampler).__name__} is not one of torch's, and it runs "
                       "in this process at every fetch (pass prefetch=1 if it draws nothing "
                       "from the default CPU generator)"), None
        if own_state and not stateful:
            return 0, (f"{type(loader).__name__} keeps its own position (state_dict), which "
                       "spbcast cannot take back by a batch fetched ahead (pass prefetch=1 "
                       "if its save hook is cheap and local: it is then taken before each "
                       "prefetched fetch)"), None
        return 1, f"a DataLoader with {loader.num_workers} workers", ("snapshot" if own_state else None)

    def _rewound(self, batches):
        """A context in which the loader's own state is as before the prefetched ``batches``
        (those fetched but not taken): for a loader whose _prefetch_policy says "rewind"."""
        raise NotImplementedError

    def _close_prefetch(self):
        if self._prefetcher is None or not self._prefetcher.usable():
            return
        wait = _seconds(self.timeout) or _DEFAULT_TIMEOUT
        try:
            if self.is_leader:
                self._settle()
                self._in_flight.clear()
                if self._listening:  # the followers' threads are receiving: end them
                    stop = {"error": None, "epoch": -1, "step": -1, "words": 0, "done": False,
                            "batch": None, "seconds": 0.0, "kind": "stop"}
                    self._prefetcher.submit(lambda: self._send_step(stop, self._channel, "stop")).result(wait)
            elif self._following is not None:
                concurrent.futures.wait([self._following], wait)
        except Exception:  # noqa: BLE001 - closing: a peer gone already is no error of close's
            pass
        if self._prefetcher.stop(wait):
            _prefetch.release(self._channel)

    def stats(self):
        """What the loop's broadcasts did on this rank, so far: ``path`` - how batches travel
        ("same_host": the followers map the leader's shared pages; "hierarchical": relayed once
        per host; "network": over the group's sockets; "local": no dedup, every rank loads),
        ``steps`` and ``bytes`` (the batches' tensor bytes), ``loader_seconds`` (the leader: in
        its loader), ``broadcast_seconds`` (in the steps' broadcasts - on a follower that
        includes waiting for the leader's loader), ``leader_loader_seconds`` (a follower: the
        leader's loader time for the same steps, so the transfer is about broadcast_seconds
        minus it), ``wait_seconds`` (what the trainer waited in next(): with prefetch, only for
        what was not here yet), ``prefetch`` (the depth in use: 0, synchronous) with
        ``prefetch_reason`` (why that depth), and ``prefetch_hits`` (steps whose batch was here
        when the trainer asked for it)."""
        return dict(self._stats, path=self._path(), prefetch=self.prefetch,
                    prefetch_reason=self.prefetch_reason)

    def _path(self):
        if not self.dedup:
            return "local"
        if self.transport == "network":  # the group's same-host state is for other broadcasts
            return "network"
        # A group over several hosts keeps a same-host state too (each host's own ranks): the
        # relay says which it is.
        if _relay_hosts(self._steps_group(), self._leader):
            return "hierarchical"
        return "same_host" if self._same_host_path() else "network"

    def _same_host_path(self):
        return _same_host_path(self._steps_group(), self._leader) is True

    def _steps_group(self):
        # The group the steps travel on: with prefetch the channel, once its first broadcast
        # decided its path (the SP group's loader_init decided the same for the same ranks).
        if self._channel is not None and _same_host_path(self._channel, self._leader) is not None:
            return self._channel
        return self.group

    def _count_step(self, received, batch, seconds, waited):
        stats = self._stats
        stats["broadcast_seconds"] += seconds
        stats["wait_seconds"] += waited
        if received["done"]:
            if self.log_every:
                self._log(self._summary())
            return
        stats["steps"] += 1
        stats["bytes"] += _tensor_bytes(batch)
        if self.is_leader or not self.dedup:
            stats["loader_seconds"] += received["seconds"]
        else:
            stats["leader_loader_seconds"] += received["seconds"]
        if self.log_every and stats["steps"] % self.log_every == 0:
            self._log(self._summary())

    def _summary(self):
        s = self.stats()
        line = (self._where() + f": {s['steps']} steps on the {s['path']} path, "
                f"{s['bytes'] / (1 << 20):.1f} MiB")
        if s["prefetch"]:
            line += f", prefetch {s['prefetch']} ({s['prefetch_hits']} steps' batches were here)"
        else:
            line += f", no prefetch ({s['prefetch_reason']})"
        line += f"; the trainer waited {s['wait_seconds']:.2f} s"
        if self.is_leader:
            return line + (f"; {s['loader_seconds']:.2f} s in the loader, "
                           f"{s['broadcast_seconds']:.2f} s broadcasting")
        return line + (f"; {s['broadcast_seconds']:.2f} s in the broadcasts, "
                       f"{s['leader_loader_seconds']:.2f} s of it the leader's loader")

    def _broadcast_options(self):
        return dict(timeout=self.timeout, root_wait=self.root_wait, transport=self.transport,
                    relay_chunk_bytes=self.relay_chunk_bytes)

    def _leader_failed(self, doing, error, cause=None):
        """What every SP rank raises when the leader failed ``doing``: ``error`` is the leader's
        _describe() of it. The loader's own exception becomes a LoaderError that is also of its
        type where it can be (on the leader, any type, chained to the exception itself); a
        refusal by spbcast keeps its code."""
        message = self._where() + f": the SP leader (rank {self._leader}) failed {doing}: {error['text']}"
        if error["code"] != "loader":
            raise_as = Error(message, error["code"])
        else:
            original = cause.__cause__ if isinstance(cause, LoaderError) else cause
            raise_as = loader_error(message, error["type"], error["original"],
                                    type(original) if original is not None else None)
        raise_as.__cause__ = cause
        return raise_as

    def _send_step(self, envelope, group, name=None):
        """The step's envelope on every rank (the leader's own; on followers the body with the
        batch still in wire form, its metadata checked), and on the leader the refusal if its
        batch was refused. A batch the root refuses (spbcast cannot send it) is followed by the
        same envelope without the batch, with the refusal as its error: the step's draws and
        counters reach every rank. A refused batch counts as a step (the loader produced it): a
        trainer that skips it goes on at the same step everywhere."""
        name = name or (f"step[{envelope['step']}]" if envelope is not None else "the next step")
        if not self.is_leader:
            received, refused = _receive_step(group, self._leader, self._broadcast_options(), name)
            return self._checked_step(received), refused
        kw = self._broadcast_options()
        try:
            broadcast(envelope, group, self._leader, _name=name, **kw)
            return envelope, None
        except (TransportError, RemoteError):
            raise
        except Error as refused:  # the batch refused by spbcast (followers got RemoteError)
            envelope = dict(envelope, batch=None, done=False, error=_describe(refused))
            broadcast(envelope, group, self._leader, _name=name + " (refused)", **kw)
            return envelope, refused

    def _checked_step(self, body):
        if type(body) is dict and body.get("error") is not None:  # still in wire form
            body["error"] = decode_body(body["error"], self.rank, f"step[{body.get('step')}][\"error\"]")
        if type(body) is dict and set(body) == {"error", "warning"}:
            raise Error(self._where() + f": the SP leader (rank {self._leader}) is in load_state_dict "
                        "while this rank fetches a step: call load_state_dict on every SP rank "
                        "(followers may pass None)", "out_of_step")
        if not (type(body) is dict and set(body) == {"error", "epoch", "step", "words", "done", "batch",
                                                     "seconds", "kind"}
                and type(body["seconds"]) is float
                and body["kind"] in ("step", "prefetched", "marker", "stop")
                and _is_description(body["error"])
                and type(body["epoch"]) is int and type(body["step"]) is int
                and type(body["done"]) is bool):
            raise Error(self._where() + f": the SP leader (rank {self._leader}) sent a step that is "
                        "not a LeaderLoader envelope (is the same spbcast installed on every rank?)",
                        "corrupt_frame")
        return body

    def _still_working(self):
        # Only around the leader's work inside the step protocol (building the loader, fetching
        # a batch), where every follower is already waiting in the broadcast that follows, as in
        # C++ leader_loader - on the channel the steps travel on. state_dict()/load_state_dict()
        # run outside it: the followers may be in another collective then, which a keep-alive
        # frame would put out of step.
        group = self._channel if self._channel is not None else self.group
        return _keep_alive(group, self._leader, timeout=self.timeout, transport=self.transport)

    def _fetching_in_shared_memory(self):
        return shared_memory() if self._batches_in_shared_memory() else contextlib.nullcontext()

    def _batches_in_shared_memory(self):
        # loader.hpp's batches_in_shared_memory(): only when the (group, leader) takes the
        # same-host path, which the first broadcast (loader_init) decided, and the switch is on.
        if not self.leader_allocates_in_shared_memory or self.transport == "network":
            return False
        return self._same_host_path()

    def _fetch(self, words):
        """The one fetch/epoch loop: the next batch of the current pass; at the end of a pass,
        start the next one (or, with set_epoch=None, end the iteration). Counts the generator
        words into words[0] (None: not counted, dedup is off)."""
        if self._finished or (self.total_step is not None and self.step >= self.total_step):
            self._finished = True
            return _END
        empty_passes = 0
        while True:
            if self._iter is None and self._start_workers_first:
                self._start_persistent_workers()
            if self._iter is None and self._replay_from is not None:
                self._replay_pass()
            if self._iter is None:
                self._pass_ended = False
                self._pass_generators = self._generator_states()
                self._fetches_in_pass = 0
                self._pass_resets_workers = _persistent_iterator(self.loader) is not None
                self._iter = self._call(iter, self.loader, words, "creating the loader's iterator")
            try:
                if self._pass_ended:  # a prefetched fetch found it ended (its marker was taken)
                    self._pass_ended = False
                    batch = _END
                else:
                    batch = self._call(next, self._iter, words, "fetching a batch", _END)
            except Exception:
                self._fetches_in_pass += 1  # a fetch that raised took its samples all the same
                raise
            self._fetches_in_pass += batch is not _END
            if self._end_of_epoch_pending:
                self._end_of_epoch_pending = False
                if batch is _END:  # the restored epoch's end (see load_state_dict)
                    self._iter = None
                    continue
            if batch is not _END and self._skip > 0:
                self._skip -= 1
                continue
            if batch is not _END:
                self.step += 1
                self._in_epoch += 1
                return batch
            if self.per_pass:  # the trainer starts the next pass (and calls set_epoch)
                self._iter, self._in_epoch, self._skip = None, 0, 0
                self._pass += 1
                return _END
            self._end_pass(words)
            if self.total_epoch is not None and self._pass >= self.total_epoch:
                self._finished = True
                return _END
            empty_passes += 1
            if empty_passes == 2:
                raise Error(self._where() + ": the data loader yielded no batch for a whole epoch; "
                            "check the dataset and the sampler", "loader")

    def _generators(self):
        """The torch generators the loader's pass order may draw from, by name: the default CPU
        generator and those a DataLoader and its samplers were given."""
        found = {"default": None}
        for name, owner in (("loader", self.loader), ("sampler", getattr(self.loader, "sampler", None)),
                            ("batch_sampler.sampler",
                             getattr(getattr(self.loader, "batch_sampler", None), "sampler", None))):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
                found[name] = generator
        return found

    def _generator_states(self):
        # As lists of byte values: a state a trainer may save with json as well as torch.save.
        return {name: (torch.get_rng_state() if g is None else g.get_state()).tolist()
                for name, g in self._generators().items()}

    def _set_generators(self, states):
        """Sets the generators named in ``states`` (as _generator_states wrote them); one the
        loader no longer has is skipped."""
        generators = self._generators()
        for name, state in states.items():
            state = torch.tensor(state, dtype=torch.uint8)
            if name == "default":
                torch.set_rng_state(state)
            elif name in generators:
                generators[name].set_state(state)

    @contextlib.contextmanager
    def _borrowed_generators(self):
        """Every generator the loader's order may draw from, given back as it was: what runs
        inside draws nothing that BASE drew (nothing to mirror either)."""
        states = self._generator_states()
        try:
            yield
        finally:
            self._set_generators(states)

    def _start_persistent_workers(self):
        """Resuming a DataLoader with persistent workers that the continuous run started in an
        earlier pass: there the next pass's iter() reset them and drew no base seed, where a
        fresh DataLoader's first iter() draws one before the sampler's seed - a pass order one
        draw off, and a default generator that is no longer BASE's. So its workers are started
        first, with every generator borrowed, and the pass's iter() resets them as in the
        continuous run. (The few samples they fetch meanwhile are dropped by that reset.)"""
        self._start_workers_first = False
        if _persistent_iterator(self.loader) is None:
            with self._borrowed_generators():
                iter(self.loader)

    def _replay_pass(self):
        """Resuming mid-pass without the loader's own state: the pass is started again from the
        generators it started from and the batches taken before the checkpoint are drawn and
        dropped, so the order is the continuous run's. The default generator is the trainer's:
        it is borrowed for the replay and given back as it was (nothing to mirror); the loader's
        own generators end where the continuous run's are."""
        saved, trainers = self._replay_from, torch.get_rng_state()
        self._replay_from = None
        self._set_generators(saved)
        try:
            self._pass_resets_workers = _persistent_iterator(self.loader) is not None
            self._iter = iter(self.loader)
            for _ in range(self._skip):
                try:
                    if next(self._iter, _END) is _END:
                        break
                except Exception:  # noqa: BLE001 - the continuous run raised it at its step
                    pass
        finally:
            torch.set_rng_state(trainers)
            self._pass_generators, self._fetches_in_pass, self._skip = saved, self._skip, 0

    def _own_sampler(self):
        """A DataLoader's sampler that is not one of torch's (what it carries from one pass to
        the next spbcast cannot restore), or None."""
        if (not isinstance(self.loader, torch.utils.data.DataLoader) or self._replay_is_exact()
                or isinstance(self.loader.dataset, torch.utils.data.IterableDataset)):
            return None
        return _sampler_of(self.loader)

    def _replay_is_exact(self):
        """Whether replaying a pass from its generators gives the continuous run's order: a
        DataLoader whose sampler is one of torch's own (else a sampler's order may depend on
        what spbcast cannot capture: Python's or numpy's generators, a dataset's own state)."""
        return (isinstance(self.loader, torch.utils.data.DataLoader)
                and type(_sampler_of(self.loader)) in _REPLAYABLE_SAMPLERS)

    def _call(self, fn, arg, words, doing, *default):
        if words is None:
            return fn(arg, *default)
        return self._counted(words, doing, fn, arg, *default)

    def _counted(self, words, doing, fn, *args):
        """fn(*args), adding the default generator words it draws to words[0] (None: dedup is
        off, nothing to count) - also when fn raises: in BASE a failing call draws as well."""
        if words is None:
            return fn(*args)
        before = torch.get_rng_state()
        try:
            out = fn(*args)
        except Exception as e:
            try:
                words[0] += self._words(before, doing)
            except Error as mirror:
                raise Error(f"{mirror} (after it raised {type(e).__name__}: {e})", "loader") from e
            raise
        words[0] += self._words(before, doing)
        return out

    def _words(self, before, doing):
        after = torch.get_rng_state()
        n = _count_words(before, after)
        if n is None:
            if _layout_known() and _initial_seed(before) != _initial_seed(after):
                what = "it reseeded it (torch.manual_seed or set_rng_state)"
            else:
                what = (f"no advance of at most {_MAX_WORDS_PER_CALL:,} 32-bit words ("
                        f"{_MAX_WORDS_PER_CALL * 4 / (1 << 20):g} MiB of random data) per call "
                        "explains it: the call drew more than that (spbcast counts the words by "
                        "stepping a copy of the generator, as long again as drawing them), "
                        "reseeded it with the same seed, or left a cached normal sample")
            raise Error(self._where() + f": {doing} changed the default CPU generator in a way "
                        f"spbcast cannot mirror on the followers: {what}; give that code (e.g. a "
                        "large augmentation) a torch.Generator of its own, or move it into "
                        "DataLoader workers (num_workers > 0)", "loader")
        return n

    def _replay(self, words):
        if type(words) is not int or not 0 <= words <= 1 << 40:
            raise Error(self._where() + f": the SP leader (rank {self._leader}) sent an invalid "
                        f"generator advance {words!r}", "corrupt_frame")
        _advance(None, words)

    # ---- epochs and work outside the steps ----------------------------------------------------

    def _start_pass(self, words):
        """Before the first pass: set_epoch as the policy says for pass 0 (a callable only)."""
        if self._epoch_for_pass is not None:
            value = self._epoch_for_pass(0)
            if value is not None:
                self._set_epoch(value, words)

    def _end_pass(self, words=None):
        self._iter = None
        self._pass += 1
        self.epoch += 1
        self._in_epoch = 0
        if self.total_epoch is not None and self._pass >= self.total_epoch:
            return  # the last pass: no set_epoch for a pass that will not run (nor in BASE)
        value = self._epoch_for_pass(self._pass) if self._epoch_for_pass is not None else None
        if value is not None:
            self._set_epoch(value, words)

    def _set_epoch(self, epoch, words=None):
        self._epoch_value = epoch
        for target in (self.loader, getattr(self.loader, "sampler", None),
                       getattr(self.loader, "batch_sampler", None),
                       getattr(getattr(self.loader, "batch_sampler", None), "sampler", None)):
            if target is not None and hasattr(target, "set_epoch"):
                self._counted(words, f"calling set_epoch({epoch!r}) on the loader", target.set_epoch, epoch)
                return

    def _leader_work(self, doing, work):
        """work(words) on this rank's loader: at once without dedup; on the dedup leader at its
        next fetch, inside the step (see the module's docstring)."""
        if not self.dedup:
            work(None)
        else:
            self._pending.append((doing, work))

    def _run_pending(self, words):
        pending, self._pending = self._pending, []
        for doing, work in pending:
            try:
                work(words)
            except Error:
                raise
            except Exception as e:  # noqa: BLE001 - named, then sent to the followers
                raise loader_error(f"{doing} raised {type_name(type(e))}: {e}", type_name(type(e)), str(e),
                                   type(e)) from e

    def _run_pending_outside_step(self):
        # state_dict() must see what set_epoch / load_state_dict asked for; run on the leader
        # alone, outside any step, so no keep-alive (followers may be in another collective),
        # and the words they draw are sent with the next step.
        if self._pending:
            words = [0]
            try:
                self._run_pending(words)
            finally:  # a call that raised drew its words too
                self._carried_words += words[0]

    def _outside_step(self, doing, fn):
        words = None if not self.dedup else [0]
        out = self._counted(words, doing, fn)
        if words is not None:
            self._carried_words += words[0]
        return out

    def _save_hook(self):
        if self.state_hooks is not None:
            save = self.state_hooks[0]
            return lambda *a, **k: save(self.loader, *a, **k)
        for name in ("state_dict", "get_state_dict"):
            fn = getattr(self.loader, name, None)
            if callable(fn):
                return fn
        return None

    def _load_hook(self):
        if self.state_hooks is not None:
            load = self.state_hooks[1]
            return lambda state: load(self.loader, state)
        fn = getattr(self.loader, "load_state_dict", None)
        return fn if callable(fn) else None

    def _local_length(self):
        try:
            return len(self.loader)
        except TypeError:
            return -1

    def _where(self):
        # Global ranks, as the rest of spbcast names them (and torch.distributed's src=); the
        # position in the SP group after it.
        return f"spbcast: rank {self.rank} (LeaderLoader, SP rank {self.sp_rank})"
