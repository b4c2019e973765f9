"""spbcast.broadcast between real Gloo ranks: round trips, aliasing, errors, the GIL."""

import collections
import dataclasses
import datetime
import enum
import functools
import threading
import time

import pytest
import torch
import torch.distributed as dist

import spbcast
from batches import Frozen, assert_same, every_kind, xtuner_batch
from dist_harness import run
from spbcast._wire import MAX_DEPTH


def _round_trips(rank, world):
    # Every rank builds the expected value itself; only the root's copy is sent.
    assert spbcast._C.binding_cast_works(dist.group.WORLD)
    for src in range(world):
        for make in (lambda: xtuner_batch(src), lambda: xtuner_batch(src, plain=True),
                     lambda: every_kind(src)):
            expected = make()
            got = spbcast.broadcast(expected if rank == src else None, src=src)
            if rank == src:
                assert got is expected
            else:
                assert_same(expected, got)
                if isinstance(got, list):
                    ctx = got[0]["seq_ctx"]
                    assert ctx.cu_seq_lens_k is ctx.cu_seq_lens_q
                    assert ctx.position_ids.stride()[0] == 0
                else:  # views of one storage stay views: a write shows through
                    views = got["views"]
                    views["base"][3, 1] = 1234.5
                    assert views["slice"][1, 0] == 1234.5 and views["t"][1, 3] == 1234.5
    # A subgroup of the odd ranks (and the even ones, which must create it too), a global src.
    odd = dist.new_group([r for r in range(world) if r % 2 == 1])
    even = dist.new_group([r for r in range(world) if r % 2 == 0])
    mine, src = (odd, world - 1) if rank % 2 else (even, world - 2)
    expected = every_kind(100 + src)
    got = spbcast.broadcast(expected if rank == src else None, group=mine, src=src, checksum=True)
    assert_same(expected, got)
    # The registry fallback reaches the same C++ group.
    got = spbcast.broadcast(expected if rank == src else None, group=mine, src=src,
                            _use_registry=True)
    assert_same(expected, got)


@pytest.mark.parametrize("world", [2, 4])
def test_round_trips(world):
    run(world, _round_trips, timeout=150)


def _large(rank, world):
    # The qwen3-vl image profile of shared/batches.md: 8192 x 1536 float32 patches, L = 32768.
    expected = xtuner_batch(7, length=32768, micro=2, media=8192)
    got = spbcast.broadcast(expected if rank == 1 else None, src=1, timeout=60)
    assert_same(expected, got)
    # The network path, whose followers receive into the core's receive cache: once the first
    # batch is dropped, the second is received into its large blocks.
    got = spbcast.broadcast(expected if rank == 1 else None, src=1, timeout=60, transport="network")
    assert_same(expected, got)
    if rank == 0:
        before = spbcast.receive_cache_statistics()
        assert before["blocks_allocated"] >= 2 and before["limit_bytes"] > 0
        del got
    got = spbcast.broadcast(expected if rank == 1 else None, src=1, timeout=60, transport="network")
    assert_same(expected, got)
    if rank == 0:
        assert spbcast.receive_cache_statistics()["blocks_reused"] > before["blocks_reused"]


def test_large_xtuner_batch():
    run(2, _large)


def _leader_allocates(rank, world):
    # The leader collates inside spbcast.shared_memory(): its large tensors are handed over
    # without a copy, and a later write by the leader stays its own.
    expected = xtuner_batch(3, length=32768, micro=2, media=8192)
    batch = None
    if rank == 0:
        with spbcast.shared_memory():
            batch = xtuner_batch(3, length=32768, micro=2, media=8192)
        before = spbcast.shared_memory_statistics()
    got = spbcast.broadcast(batch, src=0, timeout=60)
    assert_same(expected, got)
    if rank == 0:
        after = spbcast.shared_memory_statistics()
        assert after["tensors_shared"] > before["tensors_shared"], after
        for item in got:
            item["seq_ctx"].pixel_values.fill_(7.0)
    dist.barrier()
    if rank != 0:
        assert_same(expected, got)


def test_leader_allocates_in_shared_memory():
    run(3, _leader_allocates)


def _set(): return [{"seq_ctx": {"ids": torch.ones(2)}}, {"seq_ctx": {"a": {1, torch.ones(1)}}}]


def _lambda():
    return [0, {"seq_ctx": {"fn": lambda x: x}}]


def _meta():
    return {"t": torch.empty(3, device="meta")}


def _sparse():
    return (torch.eye(3).to_sparse(),)


def _local_class():
    class Local:
        pass
    return [Local()]


def _cycle():
    x = [1]
    x.append(x)
    return x


def _object_path():
    b = xtuner_batch(0, 256, 2, media=0)
    b[1]["seq_ctx"].pixel_values = torch.empty(2, device="meta")
    return b


REFUSED = [
    (_set, 'batch[1]["seq_ctx"]["a"]', "a set holding a Tensor"),
    (_lambda, 'batch[1]["seq_ctx"]["fn"]', "never code"),
    (_meta, 'batch["t"]', "a tensor on meta"),
    (_sparse, "batch[0]", "sparse_coo tensor"),
    (lambda: {"p": torch.nn.Parameter(torch.ones(1))}, 'batch["p"]', "subclass"),
    (_local_class, "batch[0]", "inside a function"),
    (lambda: {"big": 2**64}, 'batch["big"]', "64 bits"),
    (lambda: {1: 1, "a": 2}, "batch", "mixes str and int keys"),
    (lambda: {(1, 2): 1}, "batch", "dict key of type tuple"),
    (_cycle, "batch[1]", "cycle"),
    (_object_path, 'batch[1]["seq_ctx"].pixel_values', "a tensor on meta"),
    (lambda: collections.Counter(a=1), "batch", "a subclass of a built-in type"),
    (lambda: {"d": collections.defaultdict(lambda: 0)}, 'batch["d"]', "default_factory is <function"),
    (lambda: [torch.quantize_per_tensor(torch.ones(2), 0.1, 0, torch.qint8)], "batch[0]", "dtype torch.qint8"),
    (lambda: {"s": "x" * ((64 << 20) + 1)}, 'batch["s"]', "limit of 67108864 per string"),
    (lambda: {"b": bytes((64 << 20) + 1)}, 'batch["b"]', "torch.frombuffer"),
    (lambda: functools.reduce(lambda x, _: [x], range(MAX_DEPTH + 1), 0),
     "batch" + "[0]" * MAX_DEPTH, f"deeper than {MAX_DEPTH}"),
    (lambda: {"mode": Color.RED}, 'batch["mode"]', "spbcast.allow_classes(test_broadcast.Color)"),
    (lambda: [NotAllowed()], "batch[0]", "call spbcast.allow_classes(test_broadcast.NotAllowed) (or "
     "spbcast.allow_modules('test_broadcast'))"),
    (lambda: [object()], "batch[0]", "no __dict__"),
]


class Color(enum.Enum):  # not allowed: refused
    RED = 1


@dataclasses.dataclass
class NotAllowed:  # not allowed: refused
    a: int = 0


@dataclasses.dataclass
class Unset:
    a: int  # never set: reading it raises AttributeError


spbcast.allow_classes(Unset)


def _unset():
    return {"x": object.__new__(Unset)}


# Failures that are not a refusal by spbcast's checks: (make, words in the message).
RAISING = [(_unset, "AttributeError")]


def _errors(rank, world):
    root = world - 1
    for make, path, words in REFUSED:
        with pytest.raises(spbcast.Error) as info:
            spbcast.broadcast(make() if rank == root else None, src=root)
        e = info.value
        if rank == root:
            assert type(e) is spbcast.Error and e.code == "unsupported_value"
            assert f"cannot send {path}:" in str(e) and words in str(e), str(e)
        else:
            assert type(e) is spbcast.RemoteError and e.code == "remote"
            assert e.root_rank == root and f"cannot send {path}:" in e.root_message, str(e)
            assert words in str(e)
        # The group is still in step: the next broadcast works.
        assert spbcast.broadcast("ok" if rank == 0 else None, src=0) == "ok"
    # The deepest nesting the encoder takes also passes the core's own bound.
    for deep in (functools.reduce(lambda x, _: [x], range(MAX_DEPTH), 0),
                 functools.reduce(lambda x, _: Frozen(a=0, b=x), range(MAX_DEPTH // 2), 0)):
        got = spbcast.broadcast(deep if rank == root else None, src=root)
        assert rank == root or repr(got) == repr(deep)
    for make, words in RAISING:
        with pytest.raises(spbcast.Error, match=words) as info:
            spbcast.broadcast(make() if rank == root else None, src=root)
        assert type(info.value) is (spbcast.Error if rank == root else spbcast.RemoteError)
        assert spbcast.broadcast("ok" if rank == 0 else None, src=0) == "ok"
    with pytest.raises(spbcast.Error, match="timeout must be") as info:
        spbcast.broadcast(None, src=root, timeout=-1)
    assert info.value.code == "invalid_argument"
    # A value the core itself refuses on the root (here: nesting beyond its limits.max_depth,
    # sent past the Python checks): Error with the core's code there, RemoteError elsewhere.
    if rank == root:
        deep = functools.reduce(lambda x, _: (0, x), range(600), 0)
        with pytest.raises(spbcast.Error, match="max_depth") as info:
            spbcast._C.broadcast(dist.group.WORLD, dist.group.WORLD.group_name,
                                 spbcast._C.to_wire(deep), root, None, False)
        assert type(info.value) is spbcast.Error and info.value.code == "limit_exceeded"
    else:
        with pytest.raises(spbcast.RemoteError, match="max_depth") as info:
            spbcast.broadcast(None, src=root)
        assert info.value.root_rank == root
    assert spbcast.broadcast("ok" if rank == 0 else None, src=0) == "ok"
    # A bad src is refused on every rank before any collective.
    with pytest.raises(spbcast.Error, match="src=7 is not a rank") as info:
        spbcast.broadcast(None, src=7)
    assert info.value.code == "invalid_argument"
    # A class a follower does not allow (this program allows it on the other ranks only):
    # that follower raises SchemaError naming the path, the class and the call that allows
    # it, the others succeed, and the group stays in step (test_values.py has the rest).
    import batches
    allowed = spbcast._wire._allowed_classes
    if rank == 1:
        del allowed[("batches", "Plain")]
    try:
        if rank == 1:
            with pytest.raises(spbcast.SchemaError) as info:
                spbcast.broadcast(None, src=0)
            assert info.value.code == "schema_mismatch" and info.value.root_schema == "batches.Plain"
            assert str(info.value).startswith("spbcast: rank 1: cannot rebuild batch[0]: ")
            assert "spbcast.allow_classes(batches.Plain)" in str(info.value), str(info.value)
        else:
            obj = batches.Plain()
            obj.x = 1
            got = spbcast.broadcast([obj] if rank == 0 else None, src=0)
            assert type(got[0]) is batches.Plain and got[0].x == 1
    finally:
        allowed[("batches", "Plain")] = batches.Plain
    assert spbcast.broadcast([1] if rank == 0 else None, src=0) == [1]


@pytest.mark.parametrize("world", [2, 4])
def test_errors_on_every_rank(world):
    run(world, _errors)


def _gil_and_timeout(rank, world):
    # The GIL is released while a follower waits for the root: another thread runs meanwhile.
    if rank == 0:
        time.sleep(1.0)
        spbcast.broadcast(torch.ones(1000), src=0)
    else:
        ticks = 0
        stop = threading.Event()

        def count():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.001)

        t = threading.Thread(target=count)
        t.start()
        got = spbcast.broadcast(None, src=0)
        stop.set()
        t.join()
        assert torch.equal(got, torch.ones(1000))
        # Held, the GIL would allow a tick or two; released, hundreds (fewer on a loaded machine).
        assert ticks > 20, f"the waiting thread held the GIL ({ticks} ticks in ~1 s)"
    # A root that never sends: the follower's wait ends with TransportError (code timeout) after
    # `timeout`, on a group of its own, which counts as broken afterwards.
    lonely = dist.new_group([0, 1])
    if rank == 1:
        t0 = time.monotonic()
        with pytest.raises(spbcast.TransportError) as info:
            spbcast.broadcast(None, group=lonely, src=0, timeout=1.0)
        assert info.value.code == "timeout", info.value
        assert time.monotonic() - t0 < 20
    dist.barrier()


def test_gil_released_and_timeout():
    run(2, _gil_and_timeout)


def _root_wait(rank, world):
    # A root that starts 2 s late, with timeout=1 and root_wait=5: the followers' wait for its
    # first message is root_wait, the rest of the broadcast timeout. Over the same-host
    # handshake (auto, the group's first broadcast) and over the network frame.
    x = torch.arange(1 << 18)  # 2 MiB
    for transport in ("auto", "network"):
        if rank == 0:
            time.sleep(2.0)
        got = spbcast.broadcast(x if rank == 0 else None, src=0, timeout=1.0, root_wait=5.0,
                                transport=transport)
        assert torch.equal(got, x), transport
    # 0 (or a zero timedelta) means "as long as timeout".
    for zero in (0, datetime.timedelta(0)):
        assert spbcast.broadcast("ok" if rank == 0 else None, src=0, root_wait=zero) == "ok"
    # Refused on every rank before any collective.
    for bad in (-1, "5", True, datetime.timedelta(seconds=-1)):
        with pytest.raises(spbcast.Error, match="root_wait must be a positive number") as info:
            spbcast.broadcast(None, src=0, root_wait=bad)
        assert info.value.code == "invalid_argument"
    # Without root_wait the followers give up after timeout: TransportError (code timeout), on a
    # group of its own, which is broken afterwards (so the late root sends nothing on it).
    late = dist.new_group(list(range(world)))
    if rank == 0:
        time.sleep(2.0)
    else:
        t0 = time.monotonic()
        with pytest.raises(spbcast.TransportError) as info:
            spbcast.broadcast(None, group=late, src=0, timeout=1.0)
        assert info.value.code == "timeout", info.value
        assert time.monotonic() - t0 < 20
    dist.barrier()


def test_root_wait():
    run(2, _root_wait)


def test_single_rank_group():
    run(1, _single)


def _single(rank, world):
    x = {"a": torch.ones(2)}
    assert spbcast.broadcast(x) is x
