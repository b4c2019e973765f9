"""Jagged nested tensors (torch.nested, layout=torch.jagged) and tensordict's TensorDict,
NonTensorData and NonTensorStack between real Gloo ranks: rebuilt equal in everything a trainer
observes (batches.assert_same: parts bit for bit, their aliasing, ragged dimension, shape,
cached sequence lengths; keys, batch_size, device, names), from every root and over both
paths; what is refused, with what to send instead; and LeaderLoader over a DataLoader whose
workers collate jagged nested tensors, equal to BASE."""

import dataclasses
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import spbcast
from spbcast import _wire
from batches import assert_same, tensor_bytes
from dist_harness import run

jagged = torch.nested.nested_tensor_from_jagged


@spbcast.allow_classes
@dataclasses.dataclass
class Packed:
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    note: str


class NotAllowed:
    """A class this program never allows."""


def nested_cases(seed):
    """Every rank builds the same jagged nested tensors from seed."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s, dtype=torch.float32: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    plain = torch.nested.nested_tensor([r(3, 4), r(5, 4), r(0, 4)], layout=torch.jagged)
    base = r(3, 6, 2)
    narrowed = torch.nested.narrow(base, 1, torch.tensor([0, 2, 5]), torch.tensor([2, 3, 1]),
                                   layout=torch.jagged)
    shared_values = r(9, 2)
    offsets = torch.tensor([0, 4, 9])
    grad_values = r(5, 3, dtype=torch.float64).requires_grad_()
    cases = {
        "plain": plain,
        "ragged_idx_2": plain.transpose(1, 2),  # non-contiguous values
        "jagged_dim_2": jagged(r(3, 10, 4), torch.tensor([0, 3, 10]), jagged_dim=2),
        "with_lengths": narrowed,
        "leaf_grad": torch.nested.nested_tensor([r(2, 3), r(4, 3)], layout=torch.jagged,
                                                requires_grad=True),
        "view_grad": jagged(grad_values, torch.tensor([0, 2, 5])),
        "cached": jagged(r(9, 2), offsets.clone(), min_seqlen=1, max_seqlen=64),  # a loose bound
        "cached_computed": torch.nested.nested_tensor([r(2), r(7)], layout=torch.jagged),
        "int32_offsets": jagged(r(6), torch.tensor([0, 1, 6], dtype=torch.int32)),
        "empty": jagged(torch.empty(0, 3), torch.tensor([0])),
        "empty_rows": jagged(torch.empty(0, 3), torch.tensor([0, 0, 0])),
        # Aliasing: two nested tensors on one values tensor and one offsets tensor, the values
        # also in the batch (itself and a slice of it).
        "alias": {"a": jagged(shared_values, offsets), "b": jagged(shared_values, offsets),
                  "v": shared_values, "slice": shared_values[2:5], "offsets": offsets},
        "in_list": [Packed(jagged(r(5), torch.tensor([0, 2, 5])), jagged(r(5), torch.tensor([0, 2, 5])),
                           "packed")],
    }
    cases["cached_computed"]._max_seqlen  # noqa: B018 - computes and caches it on the root
    for dtype in (torch.int64, torch.bfloat16, torch.bool, torch.uint8, torch.complex64,
                  torch.float16, torch.int8):
        cases[f"dtype_{dtype}"] = jagged(r(7, 2).to(dtype), torch.tensor([0, 3, 3, 7]))
    return cases


def _check_nested(expected, got):
    assert_same(expected, got)
    a, b = got["alias"]["a"], got["alias"]["b"]
    # One values tensor and one offsets tensor on the follower too: the same ragged size.
    assert a._values is b._values is got["alias"]["v"] and a.offsets() is got["alias"]["offsets"]
    assert a.shape[1] == b.shape[1]
    assert torch.equal((a + b).values(), 2 * got["alias"]["v"])
    assert got["cached"]._max_seqlen == 64 and got["cached"]._min_seqlen == 1
    assert "max_seqlen" in got["cached_computed"]._metadata_cache
    assert "max_seqlen" not in got["int32_offsets"]._metadata_cache  # absent on the root too
    leaf = got["leaf_grad"]
    assert leaf.requires_grad and leaf.is_leaf
    (leaf * 2).values().sum().backward()  # a trainer's backward reaches it
    assert leaf.grad is not None
    assert got["view_grad"]._values.requires_grad and got["view_grad"]._values.is_leaf


def _from_every_root(rank, world, cases, check):
    """Each rank in turn broadcasts cases(itself); every other rank checks what it got."""
    for src in range(world):
        expected = cases(src)
        got = spbcast.broadcast(expected if rank == src else None, src=src)
        if rank != src:
            check(expected, got)


def _round_trips(rank, world):
    _from_every_root(rank, world, nested_cases, _check_nested)
    expected = nested_cases(9)
    got = spbcast.broadcast(expected if rank == 0 else None, src=0, transport="network")
    if rank:
        _check_nested(expected, got)


@pytest.mark.parametrize("world", [2, 3])
def test_jagged_nested_tensors_round_trip(world):
    run(world, _round_trips, timeout=150)


def test_refused_on_the_root():
    strided = torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])
    with pytest.raises(spbcast.Error) as info:
        _wire.encode({"x": strided}, 0)
    message = str(info.value)
    assert 'cannot send batch["x"]: a nested tensor of the strided layout' in message, message
    assert "layout=torch.jagged" in message and "to_padded_tensor" in message
    with pytest.raises(spbcast.Error, match=r'batch\["x"\]: a jagged nested tensor whose offsets run '
                                            r'from 0 to 10, not over its 12 values'):
        _wire.encode({"x": jagged(torch.ones(12, 2), torch.tensor([0, 3, 10]))}, 0)
    meta = jagged(torch.ones(3, device="meta"), torch.tensor([0, 3], device="meta"))
    with pytest.raises(spbcast.Error, match=r'batch\["x"\]: a nested tensor on meta; .*\(\.cpu\(\)\)'):
        _wire.encode({"x": meta}, 0)


# ---- tensordict -------------------------------------------------------------------------------

def tensordict_cases(seed):
    td = pytest.importorskip("tensordict", reason="the tensordict cases need tensordict")
    g = torch.Generator().manual_seed(seed)
    offsets = torch.tensor([0, 3, 8])
    ids = jagged(torch.randint(0, 100, (8,), generator=g), offsets)
    batch = td.TensorDict({
        "input_ids": ids,
        "position_ids": jagged(torch.arange(8), offsets),
        "loss_mask": torch.ones(2, 5),
        "sub": td.TensorDict({"x": torch.randn(2, 3, generator=g), "deeper": td.TensorDict(
            {"y": torch.zeros(2, 1, dtype=torch.int32)}, batch_size=[2, 1])}, batch_size=[2],
            names=["batch"]),
        "meta": td.NonTensorData({"temperature": 1.0, "global_token_num": [3, 5],
                                  "packed": Packed(torch.ones(2), torch.arange(2), "x")}),
        "uids": td.NonTensorStack.from_list(["a", "b"]),
        "grid": td.NonTensorStack(td.NonTensorStack(td.NonTensorData(1), td.NonTensorData(2)),
                                  td.NonTensorStack(td.NonTensorData(3), td.NonTensorData(4)),
                                  stack_dim=1),
    }, batch_size=[2])
    on_cpu = td.TensorDict({"a": torch.ones(2, 2)}, batch_size=[2, 2], device="cpu",
                           names=["b", None])
    on_cpu.set("n", td.NonTensorData("on cpu", batch_size=[2, 2], device="cpu"))
    return {
        "batch": batch,
        "on_cpu": on_cpu,
        "locked": td.TensorDict({"z": torch.zeros(3)}, batch_size=[3]).lock_(),
        "empty": td.TensorDict({}, batch_size=[]),
        "same_strs": td.NonTensorStack(td.NonTensorData("s"), td.NonTensorData("s")),
        "data": td.NonTensorData(None),
    }


def _check_tensordicts(expected, got):
    assert_same(expected, got)
    assert got["batch"]["input_ids"].offsets() is got["batch"]["position_ids"].offsets()
    assert got["batch"]["uids"] == ["a", "b"] and dict(got["batch"].items())["grid"].tolist() == [[1, 3], [2, 4]]


def _tensordicts(rank, world):
    _from_every_root(rank, world, tensordict_cases, _check_tensordicts)


def test_tensordicts_round_trip():
    pytest.importorskip("tensordict", reason="the tensordict cases need tensordict")
    run(2, _tensordicts, timeout=150)


def test_tensordict_stays_optional():
    # Without tensordict: spbcast imports and sends jagged nested tensors, and a tensordict value
    # from a root is a SchemaError naming the path on that follower.
    code = """
import sys
sys.modules["tensordict"] = None  # import tensordict raises ImportError
import torch
import spbcast
from spbcast import _C, _wire as w
nt = torch.nested.nested_tensor_from_jagged(torch.arange(5.0), torch.tensor([0, 2, 5]))
got = w.decode(_C.through_wire(w.encode({"nt": nt}, 0)), 1, 0)["nt"]
assert torch.equal(got.values(), nt.values()) and got.offsets().tolist() == [0, 2, 5]
env = (w.MAGIC, w.WIRE_VERSION, w.KIND_VALUE, {"td": (w.TAG_NON_TENSOR_DATA, 1, [], None)})
try:
    w.decode(env, 1, 0)
except spbcast.SchemaError as e:
    print(e)
assert "tensordict" not in sys.modules or sys.modules["tensordict"] is None
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ('cannot rebuild batch["td"]: the root sent a tensordict value and tensordict is not '
            "installed on this rank") in out.stdout, out.stdout + out.stderr


def test_tensordict_refusals_on_the_root():
    td = pytest.importorskip("tensordict", reason="the tensordict cases need tensordict")
    stacked = td.LazyStackedTensorDict(td.TensorDict({"a": torch.ones(1)}, []),
                                       td.TensorDict({"a": torch.ones(1)}, []), stack_dim=0)
    for value, words in [
        (stacked, "tensordict._lazy.LazyStackedTensorDict; spbcast sends the tensordict classes "
                  "TensorDict, NonTensorData and NonTensorStack: send td.to_tensordict()"),
        (td.TensorDict({"x": stacked}, []), 'batch["x"]: a TensorDict entry of the class tensordict._lazy.LazyStackedTensorDict; '
                                         "spbcast sends TensorDicts of tensors"),
        (td.TensorDict({"m": td.NonTensorData(NotAllowed())}, []),
         'batch["m"].data: an instance of test_nested.NotAllowed, a class spbcast rebuilds only when '
         "the program allows it"),
    ]:
        with pytest.raises(spbcast.Error) as info:
            _wire.encode(value, 0)
        assert words in str(info.value), str(info.value)


# ---- LeaderLoader over a DataLoader that collates jagged nested tensors -----------------------

class VarLen(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(100 + i)
        n = 2 + (i * 7) % 11
        # Drawn from the worker's generator, which PyTorch seeds from the loader's base seed
        # (the leader's draw, mirrored on followers).
        return torch.randint(0, 1000, (n,), generator=g) + torch.randint(0, 3, (1,)), torch.randn(n, 4, generator=g)


def collate_jagged(items):
    lens = torch.tensor([len(ids) for ids, _ in items])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    ids = jagged(torch.cat([ids for ids, _ in items]), offsets)
    embeds = jagged(torch.cat([e for _, e in items]), offsets)
    return {"input_ids": ids, "embeds": embeds.transpose(1, 2), "labels": jagged(ids.values().roll(-1), offsets),
            "offsets": offsets}


def _make_loader():
    return DataLoader(VarLen(), batch_size=4, collate_fn=collate_jagged, num_workers=2, shuffle=True)


def _loader_equals_base(rank, world):
    torch.manual_seed(77)
    base = list(_make_loader())
    torch.manual_seed(77)
    ll = spbcast.LeaderLoader(_make_loader, dist.group.WORLD, sp_media_dedup=True, total_epoch=1)
    got = list(ll)
    assert len(got) == len(base) == 4
    for i, (b, d) in enumerate(zip(base, got)):
        assert_same(b, d, f"step {i + 1}")
        assert d["input_ids"].offsets() is d["offsets"] or rank == 0
        assert torch.equal(tensor_bytes(d["input_ids"].values()), tensor_bytes(b["input_ids"].values()))


def test_leader_loader_over_jagged_batches():
    run(2, _loader_equals_base, timeout=150)
