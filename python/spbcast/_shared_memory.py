"""Tensors born in the same-host path's shared memory (README: "The same-host path")."""

import contextlib

from . import _C


@contextlib.contextmanager
def shared_memory(min_bytes: int = 1 << 20):
    """Inside the block, CPU tensors of at least ``min_bytes`` (64 KiB at least) that this thread
    allocates live in spbcast's shared memory. A broadcast of such a tensor over the same-host
    path hands its segment to the followers instead of copying it, so the SP group holds one
    copy of the batch. Wrap the collate function on the SP leader (in the thread that collates:
    DataLoader worker processes hand their batches over in torch's own shared memory, which the
    broadcast copies once). Outside the block tensors are ordinary."""
    scope = _C.SharedMemoryScope(int(min_bytes))
    try:
        yield
    finally:
        scope.close()  # on the thread that opened it: the scope is per thread


def shared_memory_statistics() -> dict:
    """The root's segment pool: limit, cached and held bytes, segments reused and created,
    network fallbacks, tensors allocated in shared memory and tensors sent without a copy."""
    return _C.shared_memory_statistics()
