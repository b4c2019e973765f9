"""The same-host path's shared memory from Python: the pool's controls and the
spbcast.shared_memory() scope, closed on its own thread, on another one, or never."""

import gc
import threading

import pytest
import torch

import spbcast
from dist_harness import run
from spbcast._broadcast import _same_host_path

MIB = 1 << 20


def _allocated():
    return spbcast.shared_memory_statistics()["tensors_allocated"]


def _pool_controls(rank, world):
    stats = spbcast.shared_memory_statistics
    # The limit is the pool's (each rank's own).
    spbcast.set_shared_memory_limit(3 * MIB)
    assert stats()["limit_bytes"] == 3 * MIB
    for bad in (-1, 1.5, "1", True):
        with pytest.raises(spbcast.Error, match="non-negative int of bytes") as info:
            spbcast.set_shared_memory_limit(bad)
        assert info.value.code == "invalid_argument"
    # A tensor born in shared memory and dropped leaves its segment cached for reuse, within the
    # limit; release_shared_memory frees it.
    with spbcast.shared_memory():
        t = torch.empty(2 * MIB, dtype=torch.uint8)
    del t
    assert stats()["cached_bytes"] >= 2 * MIB, stats()
    spbcast.release_shared_memory()
    assert stats()["cached_bytes"] == 0, stats()
    # Limit 0 keeps nothing.
    spbcast.set_shared_memory_limit(0)
    with spbcast.shared_memory():
        t = torch.empty(2 * MIB, dtype=torch.uint8)
    del t
    assert stats()["cached_bytes"] == 0, stats()
    spbcast.set_shared_memory_limit(2 << 30)
    # The bounds at once; None keeps one as it is; free_bytes alone is a fixed bound, as in C++.
    assert spbcast.set_shared_memory_limits(free_segments=4, segments=64) == {
        "free_bytes": 2 << 30, "free_segments": 4, "segments": 64, "free_batches": 0}
    assert spbcast.set_shared_memory_limits(free_segments=16, segments=256)["segments"] == 256
    assert spbcast.set_shared_memory_limits(free_batches=2)["free_batches"] == 2
    assert spbcast.set_shared_memory_limits(free_bytes=1 << 30)["free_batches"] == 0
    spbcast.set_shared_memory_limits(free_bytes=2 << 30, free_batches=2)  # the default again
    assert {"segments", "segments_forgotten", "largest_batch_bytes"} <= stats().keys()
    assert spbcast.set_receive_cache_limits(bytes=1 << 30) == {"bytes": 1 << 30, "batches": 0}
    assert spbcast.set_receive_cache_limits(bytes=2 << 30, batches=2) == {"bytes": 2 << 30, "batches": 2}
    assert "largest_batch_bytes" in spbcast.receive_cache_statistics()
    # close_same_host_channels, called on every rank at the same point: the next broadcast runs
    # the handshake again and works on every rank; a batch received before stays intact.
    x = torch.arange(MIB)  # 8 MiB
    first = spbcast.broadcast(x if rank == 0 else None, src=0)
    assert torch.equal(first, x) and _same_host_path(None, 0) is True
    spbcast.close_same_host_channels()
    assert _same_host_path(None, 0) is None
    assert stats()["cached_bytes"] == 0
    second = spbcast.broadcast(x + 1 if rank == 0 else None, src=0)
    assert torch.equal(second, x + 1) and _same_host_path(None, 0) is True
    assert torch.equal(first, x)
    assert spbcast.broadcast("ok" if rank == 1 else None, src=1) == "ok"


def test_pool_controls():
    run(2, _pool_controls)


def _scope_lifetimes(rank, world):
    def tensor_in_shared_memory():
        before = _allocated()
        t = torch.empty(2 * MIB, dtype=torch.uint8)
        return _allocated() - before == 1, t

    with pytest.raises(spbcast.Error, match="non-negative int of bytes"):
        spbcast.shared_memory(-1)
    # Closed on its own thread; closing again does nothing; entering it again is refused.
    scope = spbcast.shared_memory()
    with scope as entered:
        assert entered is scope
        assert tensor_in_shared_memory()[0]
    assert not tensor_in_shared_memory()[0]
    scope.close()
    with pytest.raises(spbcast.Error, match="already opened"):
        scope.__enter__()
    # Dropped unclosed: collecting the object ends the scope.
    scope = spbcast.shared_memory()
    scope.__enter__()
    assert tensor_in_shared_memory()[0]
    del scope
    gc.collect()
    assert not tensor_in_shared_memory()[0], "a collected scope still allocates in shared memory"
    # Opened on thread A, closed on thread B: A's next tensor is ordinary memory.
    scope = spbcast.shared_memory()
    opened, closed = threading.Event(), threading.Event()
    result = {}

    def thread_a():
        scope.__enter__()
        result["inside"] = tensor_in_shared_memory()[0]
        opened.set()
        closed.wait()
        result["after"] = tensor_in_shared_memory()[0]

    def thread_b():
        opened.wait()
        scope.__exit__(None, None, None)
        closed.set()

    threads = [threading.Thread(target=thread_a), threading.Thread(target=thread_b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert result["inside"], "inside the scope, thread A's 2 MiB tensor was not in shared memory"
    assert not result["after"], ("the scope was closed on thread B, yet thread A still allocates "
                                 "its 2 MiB tensors in shared memory")


def test_shared_memory_scope_lifetimes():
    run(1, _scope_lifetimes)
