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


def test_the_fuzz_target_runs():
    # A few examples of python/tests/fuzz_decoder.py, so that the target stays runnable; the
    # bounded runs are scripts/fuzz_python.sh's.
    import fuzz_decoder

    fuzz_decoder.property_test(30)()
