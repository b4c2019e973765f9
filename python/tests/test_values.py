"""The Python values beyond the core's vocabulary (sets, enums, named tuples, torch.Size,
OrderedDict, defaultdict, numpy) between real Gloo ranks, and the allow-list: a follower
rebuilds only built-in kinds and classes the program allowed, and imports nothing else."""

import collections
import os
import subprocess
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist

import spbcast
from spbcast import _wire
from batches import assert_same, new_kinds
from dist_harness import run

np = pytest.importorskip("numpy")


# ---- round trips ------------------------------------------------------------------------------

def _round_trips(rank, world):
    # Every rank builds the expected value itself (sets of str iterate in another order in each
    # spawned process: its hash seed is its own); only the root's copy is sent.
    for src in range(world):
        expected = new_kinds(src)
        got = spbcast.broadcast(expected if rank == src else None, src=src)
        if rank == src:
            assert got is expected
            continue
        assert_same(expected, got)
        # An array referenced twice arrives as one array; each array is a view of the bytes
        # received, writable, and C-contiguous (the sent layout is not kept, the values are).
        twice = got["layouts"]["twice"]
        assert twice[0] is twice[1]
        assert got["layouts"]["fortran"].flags.c_contiguous and got["layouts"]["t"].flags.writeable
        assert got["xtuner"]["seq_ctx"].dsa_state.released_sources == set()
        assert type(got["xtuner"]["seq_ctx"].dsa_state.released_sources) is set
        assert got["defaults"][0]["new"] == []  # the factory works: list
        named = got["named"][0]
        assert named.y[0] is named.y[1] and named._fields == ("x", "y")
    # Over the network path too (the rest took the same-host path).
    expected = new_kinds(7)
    got = spbcast.broadcast(expected if rank == 0 else None, src=0, transport="network")
    if rank:
        assert_same(expected, got)
    # A set of str equal on every rank, whatever each process's iteration order.
    strs = {f"k{i}" for i in range(50)}
    got = spbcast.broadcast(strs if rank == 0 else None, src=0)
    assert got == strs


@pytest.mark.parametrize("world", [2, 4])
def test_new_kinds_round_trip(world):
    run(world, _round_trips, timeout=150)


def test_set_order_is_deterministic():
    # The encoded order of a set of str does not depend on the process's hash seed.
    code = ("import spbcast._wire as w; "
            "print(w.encode({'b', 'a', 'ünï', '', 'zz', 'x' * 9, 3, None, (1, 'q')}, 0))")
    outs = set()
    for seed in ("1", "2", "3"):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, "PYTHONHASHSEED": seed}, timeout=120)
        assert out.returncode == 0, out.stderr
        outs.add(out.stdout.strip().splitlines()[-1])
    assert len(outs) == 1, outs
    assert "[None, 3, '', 'a', 'b', 'xxxxxxxxx', 'zz', 'ünï', (0, 1, 'q')]" in outs.pop()


def test_numpy_stays_optional():
    # Without numpy: spbcast imports, sends every other kind, and a numpy value from a root
    # is a SchemaError naming the path on that follower.
    code = """
import sys
sys.modules["numpy"] = None  # import numpy raises ImportError
import warnings; warnings.simplefilter("ignore")
import spbcast
from spbcast import _wire as w
assert w.encode({"s": {1, 2}}, 0)
env = (w.MAGIC, w.WIRE_VERSION, w.KIND_VALUE, {"x": [(w.TAG_NUMPY_SCALAR, "<i4", b"1234")]})
try:
    w.decode(env, 1, 0)
except spbcast.SchemaError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert ('cannot rebuild batch["x"][0]: the root sent a numpy value and numpy is not '
            "installed on this rank") in out.stdout, out.stdout + out.stderr


# ---- the allow-list ---------------------------------------------------------------------------

def _send_raw(rank, body):
    """Rank 0 writes the wire itself, as another program (or a hostile peer) could: followers
    decode whatever it names. Returns what rank 1.. rebuilt, or raises what they raise."""
    pg = dist.group.WORLD
    if rank == 0:
        envelope = (_wire.MAGIC, _wire.WIRE_VERSION, _wire.KIND_VALUE, body)
        spbcast._C.broadcast(pg, pg.group_name, spbcast._C.to_wire(envelope), 0, None, False)
        return None
    return spbcast.broadcast(None, src=0)


def _refused(rank, body, *words):
    """Every follower refuses body with SchemaError whose message holds words; the group stays
    in step."""
    if rank == 0:
        _send_raw(rank, body)
    else:
        with pytest.raises(spbcast.SchemaError) as info:
            _send_raw(rank, body)
        for w in words:
            assert w in str(info.value), str(info.value)
    assert spbcast.broadcast("ok" if rank == 0 else None, src=0) == "ok"
    return None if rank == 0 else info.value


def _obj(module, qualname, fields=None):
    return (_wire.TAG_OBJECT, module, qualname, fields or {})


def _allow_list(rank, world, victim):
    # A stdlib object whose finalizer acts: a temporary file wrapper told to delete `victim`,
    # a weakref.finalize. Refused before anything is built; the file is still there.
    e = _refused(rank, {"f": _obj("tempfile", "_TemporaryFileWrapper",
                                  {"name": victim, "delete": True})},
                 'cannot rebuild batch["f"]: the root sent an instance of tempfile._TemporaryFileWrapper',
                 "call spbcast.allow_classes(tempfile._TemporaryFileWrapper) (or "
                 "spbcast.allow_modules('tempfile')) on every rank")
    assert e is None or (e.code == "schema_mismatch" and e.root_schema == "tempfile._TemporaryFileWrapper")
    _refused(rank, [_obj("weakref", "finalize")], "cannot rebuild batch[0]:", "weakref.finalize",
             "spbcast.allow_classes(weakref.finalize)")
    assert os.path.exists(victim)

    # A module nobody allowed is never imported: not by an object, an enum, a named tuple or a
    # defaultdict factory naming it, nor through a nested path.
    assert "spbcast_canary" not in sys.modules
    for body, path in [
        (_obj("spbcast_canary", "Canary"), "batch"),
        ({"e": (_wire.TAG_ENUM, "spbcast_canary", "Mode", "A")}, 'batch["e"]'),
        ([1, (_wire.TAG_NAMEDTUPLE, "spbcast_canary", "P", [1])], "batch[1]"),
        ((_wire.TAG_DEFAULTDICT, ["spbcast_canary", "Canary"], {}), "batch"),
        ((_wire.TAG_TUPLE, (_wire.TAG_SET, [1]), _obj("batches", "Plain", {"x": _obj("spbcast_canary", "Canary")})),
         "batch[1].x"),
    ]:
        _refused(rank, body, f"cannot rebuild {path}:", "spbcast_canary.",
                 "spbcast.allow_modules('spbcast_canary')")
        assert "spbcast_canary" not in sys.modules and "SPBCAST_CANARY_IMPORTED" not in os.environ

    # An allowed module gives only its own classes, by plain names: not a class it imported,
    # not a dunder walk.
    spbcast.allow_modules("batches")
    _refused(rank, _obj("batches", "torch.Tensor"), "not a class defined in batches")
    _refused(rank, _obj("batches", "__builtins__.object"), "is not the qualified name of a class")
    _refused(rank, _obj("batches", "Missing"), "which this rank cannot import: AttributeError")
    # A slotted dataclass takes its fields only (no __class__ assignment).
    _refused(rank, _obj("batches", "Slotted", {"x": 1.0, "y": [], "__class__": "x"}),
             "attribute '__class__' of batches.Slotted, which is not one of its fields")
    # Kinds and shapes the decoder does not take.
    _refused(rank, (_wire.TAG_NUMPY_ARRAY, "|O8", [1], torch.zeros(8, dtype=torch.uint8)),
             "a numpy dtype '|O8'")
    _refused(rank, _obj("batches", "Point"), "batches.Point, which is not a class of that kind")
    # An enum is rebuilt as a member, never as an object, even once found as an enum.
    _refused(rank, [(_wire.TAG_ENUM, "batches", "Color", "RED"), _obj("batches", "Color")],
             "cannot rebuild batch[1]:", "batches.Color, which is not a class of that kind")
    _refused(rank, (99, 1), "a tuple with the tag 99")

    # What the program allowed works: a registered class, a class of an allowed module, and a
    # module a follower has not imported yet, once allowed (the follower imports it then).
    got = _send_raw(rank, [_obj("batches", "Plain", {"x": 1}), _obj("batches", "Outer.Inner")])
    if rank:
        import batches
        assert type(got[0]) is batches.Plain and got[0].x == 1 and type(got[1]) is batches.Outer.Inner
    # Allowed but not imported: refused with what to do, nothing imported; with the opt-in
    # the follower imports it. Never a dunder module (mypkg.__main__ would run its code).
    spbcast.allow_modules("spbcast_canary")
    _refused(rank, _obj("spbcast_canary", "Canary"), "is not imported on this rank",
             "spbcast.allow_modules('spbcast_canary', allow_import=True)")
    assert "spbcast_canary" not in sys.modules
    spbcast.allow_modules("spbcast_canary", allow_import=True)
    _refused(rank, _obj("spbcast_canary.__main__", "Canary"), "the segment __main__")
    got = _send_raw(rank, _obj("spbcast_canary", "Canary", {"v": 2}))
    if rank:
        assert "spbcast_canary" in sys.modules and type(got).__name__ == "Canary" and got.v == 2


def test_allow_list_on_followers():
    with tempfile.NamedTemporaryFile(delete=False) as f:
        victim = f.name
    try:
        run(3, _allow_list, victim)
        assert os.path.exists(victim)
    finally:
        os.unlink(victim)


def test_allow_arguments():
    # Checked where they are called, with what to do.
    with pytest.raises(spbcast.Error, match="is not a class") as info:
        spbcast.allow_classes(len)
    assert info.value.code == "invalid_argument"

    def local():
        class Local:
            pass
        return Local
    with pytest.raises(spbcast.Error, match="inside a function; define it at module level"):
        spbcast.allow_classes(local())
    for bad in ("", "a b", "pkg.", 3):
        with pytest.raises(spbcast.Error, match="is not a module name"):
            spbcast.allow_modules(bad)
    # One class: returned, so it works as a decorator.
    import batches
    assert spbcast.allow_classes(batches.Plain) is batches.Plain


def test_encoder_refuses_what_followers_would():
    # On the root, before anything is sent (test_broadcast checks every rank hears it).
    import batches
    for value, path, words in [
        ({"d": collections.defaultdict(lambda: [])}, 'batch["d"]', "default_factory is <function"),
        ({"s": {1, (2, torch.ones(1))}}, 'batch["s"]', "a set holding a tuple"),
        ({"a": np.array([object()])}, 'batch["a"]', "a numpy array of dtype object"),
        ({"a": np.zeros(2, dtype=[("x", "<i4")])}, 'batch["a"]', "structured"),
        ({"m": np.ma.masked_array([1, 2])}, 'batch["m"]', "a subclass of a numpy type; send np.asarray"),
        ({"s": {batches.Color.RED, _wire}}, 'batch["s"]', "a set holding a module"),
    ]:
        with pytest.raises(spbcast.Error) as info:
            _wire.encode(value, 0)
        assert f"cannot send {path}: " in str(info.value) and words in str(info.value), str(info.value)
