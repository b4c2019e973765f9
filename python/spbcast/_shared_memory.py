"""Tensors born in the same-host path's shared memory, and the controls of the segment pool
(docs/transports.md, "The same-host path"; C++ include/spbcast/shared_memory.hpp)."""

import operator
import threading

from . import _C
from .errors import Error


class _SharedMemoryScope:
    """What ``spbcast.shared_memory()`` returns: a ``spbcast::shared_memory_scope`` opened on
    ``__enter__`` and closed exactly once - by ``__exit__``/``close()`` on whichever thread calls
    it, or, when the object is dropped unclosed, by the C++ object's destructor."""

    def __init__(self, min_bytes):
        self._min_bytes = min_bytes
        self._scope = None
        self._entered = False
        self._lock = threading.Lock()  # a close racing another close, or an __enter__

    def __enter__(self):
        with self._lock:
            if self._entered:
                raise Error("spbcast: this shared_memory() scope was already opened; call "
                            "spbcast.shared_memory() again for a new one", "invalid_argument")
            self._entered = True
            # Per thread in C++: the tensors of the thread that enters are the ones affected.
            self._scope = _C.SharedMemoryScope(self._min_bytes)
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def close(self):
        """Ends the scope (from any thread); later calls do nothing."""
        with self._lock:
            scope, self._scope = self._scope, None
        if scope is not None:
            scope.close()


def shared_memory(min_bytes: int = 1 << 20):
    """A context manager: inside the block, CPU tensors of at least ``min_bytes`` (64 KiB at
    least) that the thread which entered it allocates live in spbcast's shared memory. A
    broadcast of such a tensor over the same-host path hands its segment to the followers instead
    of copying it, so the SP group holds one copy of the batch. Wrap the collate function on the
    SP leader (in the thread that collates: DataLoader worker processes hand their batches over
    in torch's own shared memory, which the broadcast copies once). Outside the block tensors are
    ordinary. The block is normally closed on the thread that opened it; closing it elsewhere
    (``close()`` or ``__exit__`` on another thread) ends it too."""
    return _SharedMemoryScope(_bytes("shared_memory(min_bytes)", min_bytes))


def shared_memory_statistics() -> dict:
    """The root's segment pool: limit, cached and held bytes, segments reused and created,
    network fallbacks, tensors allocated in shared memory and tensors sent without a copy, the
    segments tracked now (one descriptor each) and those forgotten (left to their mappers)."""
    return _C.shared_memory_statistics()


def _bytes(name, value):
    """A byte count as an int, refused with a clear error (not pybind11's TypeError)."""
    try:
        n = operator.index(value)
    except TypeError:
        n = -1
    if isinstance(value, bool) or not 0 <= n < 1 << 64:
        raise Error(f"spbcast: {name} needs a non-negative int of bytes (got {value!r})",
                    "invalid_argument")
    return n


def set_shared_memory_limit(bytes: int) -> None:  # noqa: A002 - the C++ name
    """Bounds the free segments this process keeps for reuse as a root (default 2 GiB); 0 keeps
    none, so every batch fills fresh pages. Free segments beyond the new bound are freed now."""
    _C.set_shared_memory_limit(_bytes("set_shared_memory_limit", bytes))


def set_shared_memory_limits(free_bytes=None, free_segments=None, segments=None, free_batches=None) -> dict:
    """Sets the pool's bounds (docs/transports.md, "The same-host path", Bounds); None keeps a bound as it
    is. Free segments are kept for reuse up to max(free_bytes, free_batches x the largest batch
    placed so far) and free_segments of them (defaults 2 GiB, 2 batches, 16); segments bounds
    every segment the root tracks, each costing it a descriptor (default 256). free_bytes given
    without free_batches is a fixed bound (free_batches 0), as in C++. Returns the bounds now in
    use."""
    def optional(name, value):
        return None if value is None else _bytes("set_shared_memory_limits(" + name + ")", value)

    if free_bytes is not None and free_batches is None:
        free_batches = 0
    in_use = _C.set_shared_memory_limits(optional("free_bytes", free_bytes), optional("free_segments", free_segments),
                                         optional("segments", segments), optional("free_batches", free_batches))
    return dict(zip(("free_bytes", "free_segments", "segments", "free_batches"), in_use))


def set_receive_cache_limits(bytes=None, batches=None) -> dict:  # noqa: A002 - the C++ name
    """Sets the followers' receive cache budget: up to max(bytes, batches x the largest batch
    received so far) kept between batches (defaults 2 GiB and 2 batches); None keeps a bound as
    it is, and bytes given without batches is a fixed budget (batches 0). Returns the budget now
    in use. (set_receive_cache_limit(bytes): fixed, 0 turns the cache off.)"""
    if bytes is not None and batches is None:
        batches = 0
    in_use = _C.set_receive_cache_limits(None if bytes is None else _bytes("set_receive_cache_limits(bytes)", bytes),
                                         None if batches is None else _bytes("set_receive_cache_limits(batches)", batches))
    return dict(zip(("bytes", "batches"), in_use))


def release_shared_memory() -> None:
    """Frees every free segment of this process's pool now. Segments a follower still maps are
    freed by the kernel when that follower drops its last tensor over them."""
    _C.release_shared_memory()


def close_same_host_channels() -> None:
    """Closes every same-host connection of this process and frees the free segments; the next
    broadcast on a group runs the same-host handshake again. Every rank of a group must call it
    at the same point (between broadcasts), like a collective."""
    _C.close_same_host_channels()
