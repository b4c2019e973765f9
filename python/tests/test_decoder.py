"""A follower's decoder fed malformed wire trees directly: every one is a spbcast.SchemaError
(or RemoteError for a well-formed error envelope), never another exception, and nothing is
allocated that the frame did not pay for.

The trees go through _C.through_wire - the C++ conversion a follower runs on what the core
rebuilt - and then the Python decoder, with no group: the core's frame bytes are fuzzed by
scripts/fuzz.sh, the Python decoder by python/tests/fuzz_decoder.py (scripts/fuzz_python.sh),
whose findings are kept here.
"""

import tracemalloc

import pytest
import torch

import spbcast
from spbcast import _C, _wire

import batches  # noqa: F401 - allows batches.Plain, as every rank of a program would

np = pytest.importorskip("numpy", reason="the numpy cases need numpy")

W = _wire
# The most a malformed tree may cost: Python's own bookkeeping, far below any array it names.
_PAID = 1 << 20


def _envelope(body):
    return (W.MAGIC, W.WIRE_VERSION, W.KIND_VALUE, body)


def _decode(tree):
    return W.decode(_C.through_wire(tree), 1, 0)


def _refused(tree, *words, code=None):
    """The decoder refuses tree with a SchemaError holding words, within _PAID bytes."""
    tracemalloc.start()
    try:
        with pytest.raises(spbcast.SchemaError) as info:
            _decode(tree)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < _PAID, f"{peak} bytes allocated to refuse {str(info.value)[:80]}"
    for w in words:
        assert w in str(info.value), str(info.value)
    if code is not None:
        assert info.value.code == code
    return info.value


def _bytes(n):
    return torch.zeros(n, dtype=torch.uint8)


@pytest.mark.parametrize("dtype", ["<i3", "<M8[abc]", "<m8[xyz]", ">u5", "|V0", "<U0", "|S0"])
def test_numpy_dtypes_numpy_does_not_take(dtype):
    # They pass the dtype pattern but are no numpy dtype, or one of zero-sized elements.
    _refused(_envelope((W.TAG_NUMPY_ARRAY, dtype, [1], _bytes(3))), f"a numpy dtype {dtype!r}",
             code="corrupt_frame")
    _refused(_envelope([(W.TAG_NUMPY_SCALAR, dtype, (W.TAG_BYTES, b"abc"))]), "cannot rebuild batch[0]",
             f"a numpy dtype {dtype!r}")


def test_zero_sized_elements_are_not_widened():
    # Zero bytes sent; numpy would widen "|S0" to one byte an element and ask for 1 TiB.
    _refused(_envelope((W.TAG_NUMPY_ARRAY, "|S0", [2**40], _bytes(0))), "a numpy dtype '|S0'")


@pytest.mark.parametrize("shape", [[0, 2**40, 2**40], [0, 2**31, 2**31], [2**62, 0, 4], [0] * 65])
def test_empty_arrays_whose_other_dimensions_overflow(shape):
    _refused(_envelope({"a": (W.TAG_NUMPY_ARRAY, "<f8", shape, _bytes(0))}), 'cannot rebuild batch["a"]')


def test_empty_arrays_within_numpy_bounds_decode():
    a = _decode(_envelope((W.TAG_NUMPY_ARRAY, "|u1", [0, 2**30, 2**30], _bytes(0))))
    assert a.shape == (0, 2**30, 2**30) and a.dtype == np.uint8


def test_arrays_whose_bytes_do_not_match():
    _refused(_envelope((W.TAG_NUMPY_ARRAY, "<f8", [2**40], _bytes(8))), "bytes do not match")
    _refused(_envelope((W.TAG_NUMPY_ARRAY, "<f8", [-1], _bytes(8))), "a malformed numpy array")
    _refused(_envelope((W.TAG_NUMPY_SCALAR, "<f8", (W.TAG_BYTES, b"1234"))), "bytes do not match")


def test_error_envelope_without_its_code():
    _refused((W.MAGIC, W.WIRE_VERSION, W.KIND_ERROR, "boom"), "a malformed spbcast envelope",
             code="corrupt_frame")
    _refused((W.MAGIC, W.WIRE_VERSION, W.KIND_ERROR, "boom", 7), "a malformed spbcast envelope")
    with pytest.raises(spbcast.RemoteError) as info:  # the well-formed one
        _decode((W.MAGIC, W.WIRE_VERSION, W.KIND_ERROR, "boom", "loader"))
    assert info.value.root_message == "boom" and info.value.root_rank == 0


@pytest.mark.parametrize("cut", range(4))
def test_truncated_envelopes(cut):
    whole = _envelope({"x": [1, 2]})
    _refused(whole[:cut])
    _refused(list(whole))  # a list where the envelope's tuple belongs


def test_strs_that_are_not_utf8():
    _refused(_envelope({"s": b"\xff\xfe"}), "a str that is not UTF-8")  # raw bytes: an IValue str
    _refused((W.MAGIC, W.WIRE_VERSION, W.KIND_ERROR, b"\xc3", "loader"), "a str that is not UTF-8")
    # The tagged form carries "surrogatepass" bytes: other bytes are still refused.
    _refused(_envelope([(W.TAG_SURROGATE_STR, b"\xff")]), "not UTF-8 even with surrogates")
    _refused(_envelope([(W.TAG_SURROGATE_STR, 5)]), "a tuple with the tag 12")


def test_lone_surrogates_travel_tagged():
    value = {"paths": ["ok.jpg", "bad\udcff.jpg", "\ud800"]}
    tree = _C.through_wire(W.encode(value, 0))
    assert W.decode(tree, 1, 0) == value


def test_nesting_within_the_limits_decodes_and_beyond_is_refused():
    # The encoder's and the decoder's count of levels agree (MAX_DEPTH), and fit the core's
    # depth limit with the envelope's level: whatever the core passes decodes or is refused.
    assert 2 * W.MAX_DEPTH + 2 <= _C.MAX_IVALUE_DEPTH
    value = 1
    for _ in range(W.MAX_DEPTH):
        value = (value,)
    assert _decode(W.encode(value, 0)) == value
    with pytest.raises(spbcast.Error, match=f"nested deeper than {W.MAX_DEPTH} levels"):
        W.encode((value,), 0)
    for depth in (W.MAX_DEPTH + 1, 509, 600):  # 509 fits the core's 512 levels; 600 does not
        tree = 1
        for _ in range(depth):
            tree = (W.TAG_TUPLE, tree)
        _refused(_envelope(tree), f"nested deeper than {W.MAX_DEPTH} levels", code="corrupt_frame")
        _refused(_envelope([(W.TAG_OBJECT, "batches", "Plain", {"x": tree})]),
                 f"nested deeper than {W.MAX_DEPTH} levels")


# ---- jagged nested tensors and tensordict values ---------------------------------------------

def _jagged(values=None, offsets=None, lengths=None, ragged_idx=1, min_seqlen=None, max_seqlen=None,
            requires_grad=False):
    values = torch.zeros(5, 2) if values is None else values
    offsets = torch.tensor([0, 2, 5]) if offsets is None else offsets
    return (W.TAG_JAGGED, values, offsets, lengths, ragged_idx, min_seqlen, max_seqlen, requires_grad)


def test_a_well_formed_jagged_tensor_decodes():
    nt = _decode(_envelope(_jagged(lengths=torch.tensor([1, 3]), max_seqlen=3)))
    assert nt.layout == torch.jagged and nt._ragged_idx == 1 and nt._max_seqlen == 3
    assert nt.lengths().tolist() == [1, 3] and nt.offsets().tolist() == [0, 2, 5]


@pytest.mark.parametrize("tree, words", [
    (_jagged(ragged_idx=0), "ragged dimension 0 is not one of its values' 2 dimensions"),
    (_jagged(ragged_idx=3), "ragged dimension 3 is not one of its values' 2 dimensions"),
    (_jagged(ragged_idx=-1), "ragged dimension -1"),
    (_jagged(values=torch.tensor(1.0)), "ragged dimension 1 is not one of its values' 0 dimensions"),
    (_jagged(offsets=torch.tensor([0.0, 5.0])), "offsets are not a 1-d int64 or int32 tensor (torch.float32"),
    (_jagged(offsets=torch.tensor([0, 5], dtype=torch.int16)), "offsets are not a 1-d int64 or int32"),
    (_jagged(offsets=torch.tensor([[0, 5]])), "offsets are not a 1-d int64 or int32 tensor (torch.int64, 2-d)"),
    (_jagged(offsets=torch.tensor([], dtype=torch.int64)), "with no offsets"),
    (_jagged(offsets=torch.tensor([0, 4, 2, 5])), "offsets are not non-decreasing within its 5 values"),
    (_jagged(offsets=torch.tensor([-1, 5])), "offsets are not non-decreasing"),
    (_jagged(offsets=torch.tensor([0, 2, 9])), "offsets are not non-decreasing within its 5 values"),
    (_jagged(offsets=torch.tensor([0, 2, 4])), "offsets run from 0 to 4, not over its 5 values"),
    (_jagged(offsets=torch.tensor([1, 5])), "offsets run from 1 to 5"),
    (_jagged(offsets=torch.tensor([0, 2 ** 62])), "offsets are not non-decreasing within its 5 values"),
    (_jagged(lengths=torch.tensor([2, 4])), "lengths reach beyond its 5 values"),
    (_jagged(lengths=torch.tensor([2, 2 ** 62])), "lengths reach beyond its 5 values"),
    (_jagged(lengths=torch.tensor([2, -1])), "lengths reach beyond"),
    (_jagged(lengths=torch.tensor([1, 1, 1])), "with 3 lengths and 3 offsets"),
    (_jagged(lengths=torch.tensor([1.0, 1.0])), "lengths are not a 1-d int64 or int32 tensor"),
    (_jagged(values=torch.zeros(2, 5), ragged_idx=2, offsets=torch.tensor([0, 6])), "within its 5 values"),
    (_jagged(min_seqlen=-1), "a cached min_seqlen of -1"),
    (_jagged(values=torch.zeros(5, 2, dtype=torch.int64), requires_grad=True), "that torch does not build"),
    (_jagged()[:7], "a malformed jagged nested tensor"),
    (_jagged(requires_grad=1), "a malformed jagged nested tensor"),
    (_jagged(values=[1, 2]), "a malformed jagged nested tensor"),
    (_jagged(min_seqlen=1.5), "a malformed jagged nested tensor"),
])
def test_malformed_jagged_tensors(tree, words):
    _refused(_envelope({"nt": tree}), 'cannot rebuild batch["nt"]: the root sent a', words,
             code="corrupt_frame")


def _td(entries, batch, device=None, names=None, locked=False):
    return (W.TAG_TENSORDICT, entries, batch, device, names, locked)


def test_malformed_tensordicts():
    pytest.importorskip("tensordict", reason="the tensordict cases need tensordict")
    ntd = (W.TAG_NON_TENSOR_DATA, "x", [], None)
    for tree, words in [
        (_td({"x": torch.zeros(3)}, [2]), "a TensorDict of batch_size [2] whose entry 'x' is of shape [3]"),
        (_td({"x": torch.zeros(2)}, [2, 1]), "whose entry 'x' is of shape [2]"),
        (_td({"n": _jagged()}, [2, 3]), "whose entry 'n' is of shape [2, "),
        (_td({"s": _td({}, [3])}, [2]), "whose entry 's' is of shape [3]"),
        (_td({"m": (W.TAG_NON_TENSOR_DATA, "x", [3], None)}, [2]), "whose entry 'm' is of shape [3]"),
        (_td({}, [-1]), "a malformed tensordict batch_size"),
        (_td({}, [1] * 65), "a malformed tensordict batch_size"),
        (_td({}, [2], names=["a", "b"]), "names do not match its batch_size"),
        (_td({}, [2], names=[3]), "names do not match its batch_size"),
        (_td({}, [2], device="cuda"), "on the device 'cuda'"),
        (_td({"x": 3}, []), "a TensorDict entry 'x' of the class int"),
        (_td({"x": [torch.zeros(1)]}, []), "a TensorDict entry 'x' of the class list"),
        (_td({1: torch.zeros(1)}, []), "a malformed TensorDict"),
        (_td({}, [])[:5], "a malformed TensorDict"),
        ((W.TAG_NON_TENSOR_DATA, "x", [2]), "a malformed NonTensorData"),
        ((W.TAG_NON_TENSOR_DATA, "x", "2", None), "a malformed tensordict batch_size"),
        ((W.TAG_NON_TENSOR_STACK, [ntd, ntd], 1, [2]), "stack_dim 1 is not one of its 1 dimensions"),
        ((W.TAG_NON_TENSOR_STACK, [ntd, torch.zeros(1)], 0, [2]), "holding something other than"),
        ((W.TAG_NON_TENSOR_STACK, [ntd, ntd], 0, [3]), "a NonTensorStack that this rank's tensordict rebuilds differently"),
        ((W.TAG_NON_TENSOR_STACK, [ntd, (W.TAG_NON_TENSOR_DATA, "y", [2], None)], 0, [2]), "that tensordict does not build"),
    ]:
        _refused(_envelope({"td": tree}), 'cannot rebuild batch["td"]', words, code="corrupt_frame")
    # A value inside is refused with its path, as anywhere.
    _refused(_envelope({"td": _td({"m": (W.TAG_NON_TENSOR_DATA, (W.TAG_OBJECT, "os", "PathLike", {}), [], None)}, [])}),
             'cannot rebuild batch["td"]["m"].data: the root sent an instance of os.PathLike', code="schema_mismatch")


def test_the_fuzz_target_runs():
    # A few examples of python/tests/fuzz_decoder.py, so that the target stays runnable; the
    # bounded runs are scripts/fuzz_python.sh's.
    import fuzz_decoder

    fuzz_decoder.property_test(30)()
