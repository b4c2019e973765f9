"""The prefetch channel and its thread: a LeaderLoader's steps travel on a process group of their
own (the SP group's ranks, Gloo; C++: prefetch_channel.hpp), driven by one thread per rank, so a
batch is fetched and broadcast while the trainer runs its step and uses the SP group for its own
collectives. The loader's side of prefetch (what to fetch ahead, when) is _loader/prefetch.py.

Invariants, kept here:
- The channel is used by one thread at a time: jobs run one after another on the prefetch thread,
  and the trainer's thread touches the channel only where it waited for every job it submitted
  (LeaderLoader keeps that: a synchronous step is sent with no job in flight). Nothing else ever
  uses the channel, so its collectives are in the same order on every rank.
- The thread holds the LeaderLoader only through a job of its leader while the job is queued or
  runs (a follower's job holds the channel and its queue alone), so a loader dropped between
  steps can be collected; and it holds no lock while a job runs: the only lock is the queue's,
  held for an append or a pop. A process forked meanwhile (a DataLoader worker) gets no thread of ours;
  ``PrefetchThread.usable()`` is False there, and close() in it touches neither thread nor channel.
- A job's outcome, value or exception, is kept in its future and raised where the trainer asks
  for it (the step it belongs to), never on the thread.
"""

import atexit
import collections
import concurrent.futures
import datetime
import os
import threading
import weakref

import torch.distributed as dist

from .errors import Error


class PrefetchThread:
    """One thread running submitted jobs in order. ``submit(fn)`` returns a Future."""

    def __init__(self, name):
        self._pid = os.getpid()
        self._jobs = collections.deque()
        self._ready = threading.Condition(threading.Lock())
        self._stopping = False
        self._thread = threading.Thread(target=_run, args=(self._jobs, self._ready, lambda: self._stopping),
                                        name=name, daemon=True)
        self._thread.start()
        _THREADS.add(self)

    def usable(self):
        return os.getpid() == self._pid and self._thread.is_alive()

    def submit(self, fn):
        future = concurrent.futures.Future()
        with self._ready:
            self._jobs.append((fn, future))
            self._ready.notify()
        return future

    def stop(self, wait):
        """Ends the thread once the jobs submitted so far have run; waits at most ``wait``
        seconds for that (a job blocked in a receive from a leader that never sends is left to
        its timeout: the thread is a daemon, it does not hold the interpreter's exit)."""
        if os.getpid() != self._pid:
            return True  # a forked child: the thread and the channel are the parent's
        with self._ready:
            self._stopping = True
            self._ready.notify()
        self._thread.join(wait)
        return not self._thread.is_alive()


def _run(jobs, ready, stopping):
    while True:
        with ready:
            while not jobs and not stopping():
                ready.wait()
            if not jobs:
                return
            fn, future = jobs.popleft()
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - raised where the trainer takes the step
            future.set_exception(e)
        del fn, future  # nothing of a job outlives it here (the loader, its channel, a batch)


def channel(group, timeout_seconds):
    """A Gloo group over ``group``'s ranks for the prefetch's broadcasts, made (or reused) by every
    rank of ``group`` at the same point.

    torch names a group made with use_local_synchronization (only its ranks take part) by its
    ranks and the number of groups alive on this rank, and its ranks meet under that name in the
    default store: a name made again - a group destroyed, another made - would meet the keys the
    first one left there, and hang. So a channel is never destroyed: close() puts it here, and
    the next LeaderLoader on the same ranks takes it again. The SP ranks close and make their
    loaders at the same points, so they agree on which one; a loader collected without close()
    keeps its channel to itself (its ranks may not collect it at the same point)."""
    ranks = tuple(dist.get_process_group_ranks(group))
    free = _IDLE_CHANNELS.get(ranks, [])
    while free:
        idle = free.pop()
        if _alive(idle):
            return idle
    try:
        return dist.new_group(list(ranks), backend="gloo", use_local_synchronization=True,
                              timeout=datetime.timedelta(seconds=timeout_seconds))
    except (RuntimeError, ValueError, TypeError) as e:
        raise Error(f"spbcast: rank {dist.get_rank()}: cannot make the prefetch's own Gloo group "
                    f"over the SP ranks {list(ranks)}: {e}; pass prefetch=0", "invalid_argument") from e


def release(idle):
    """A channel no job uses any more, on every rank of it (close())."""
    if _alive(idle):
        _IDLE_CHANNELS.setdefault(tuple(dist.get_process_group_ranks(idle)), []).append(idle)


def _alive(group):
    # destroy_process_group() (every group) unregisters it: a later one is made anew.
    try:
        return dist.is_initialized() and dist.get_rank(group) >= 0
    except (RuntimeError, ValueError, KeyError):
        return False


# ranks -> channels of closed LeaderLoaders, taken again in order. Process-wide: touched by
# whichever thread makes or closes a loader, each change one dict or list operation under the
# GIL. A forked child starts with none: the parent's channels (their sockets) are not its own.
_IDLE_CHANNELS = {}
os.register_at_fork(after_in_child=_IDLE_CHANNELS.clear)


def close_at_exit(loader):
    """Closes ``loader`` (a LeaderLoader with a prefetch) at interpreter exit if it is still open:
    its leader ends the followers' threads, whose close waits for that."""
    _OPEN_LOADERS.add(loader)


_OPEN_LOADERS = weakref.WeakSet()
os.register_at_fork(after_in_child=_OPEN_LOADERS.clear)  # a child closes none of the parent's


# Every PrefetchThread of this process: at exit each thread gets a few seconds to finish its job,
# so that a follower's receive that ends as the peers go away (their sockets close) returns to
# Python before the interpreter finalizes (a thread coming back later is parked, _C.cpp).
_THREADS = weakref.WeakSet()
os.register_at_fork(after_in_child=_THREADS.clear)
_EXIT_WAIT_SECONDS = 5.0


@atexit.register
def _stop_threads():  # registered first: runs after _close_open_loaders
    for thread in list(_THREADS):
        thread.stop(_EXIT_WAIT_SECONDS)


@atexit.register
def _close_open_loaders():
    for loader in list(_OPEN_LOADERS):
        try:
            loader.close()
        except Exception:  # noqa: BLE001 - at exit, a peer gone already is no error
            pass
