"""The tags, the bounds, and the contract each kind of value fulfils (as C++
detail/wire/kind_traits.hpp). Every Python value the wire carries is of exactly one kind, and
everything the wire does with it - how the root writes it, how a follower rebuilds it, what
is refused on either side - is that kind's, in one place per kind (kinds.py lists them).

A kind is an instance of a Kind subclass:

    types          the Python types it writes, found by type(value) exactly
    decodes        what it rebuilds: a wire type (list, dict) or a tuple's tag
    levels         the nesting levels the kind counts against MAX_DEPTH: 0 - a value the core
                   carries as it is (no bound), 1 - a list, tuple or dict, 2 - a tagged tuple
                   (a tuple holding a container)
    as_is          the value travels as itself both ways: the codec passes it without a call
    holds_values   it can hold itself: the codec tracks it on the path (a cycle is refused)
    claims(cls, value), check(encoder, cls, value, path)
                   kinds found by class (kinds.CLASS_KINDS, in priority order): whether the
                   kind takes this class, and the checks made once per class; check returns
                   the kind that writes it or calls encoder.fail
    encode(encoder, value, path, depth)   the value in wire form (encoder: value_codec.Encoder)
    decode(decoder, value, depth)         the value rebuilt (decoder: value_codec.Decoder)

encode and decode recurse through encoder.encode(v, path, depth) and decoder.decode(v, depth)
(or decoder.elements); a refusal is encoder.fail(path, what) on the root and raises
field_path.Refused (field_path.corrupt for a malformed value) on a follower.
"""

from .. import _C

# The tags the C++ side reads too (python/csrc/_C.cpp).
TAG_TUPLE = _C.TAG_TUPLE
TAG_BYTES = _C.TAG_BYTES
TAG_OBJECT = _C.TAG_OBJECT
TAG_SURROGATE_STR = _C.TAG_SURROGATE_STR  # a str with lone surrogates (C++ side, both ways)
# Tags only this layer reads (the C++ side carries them as plain tuples).
TAG_SET = 3
TAG_FROZENSET = 4
TAG_ENUM = 5
TAG_NAMEDTUPLE = 6
TAG_SIZE = 7
TAG_ORDERED_DICT = 8
TAG_DEFAULTDICT = 9
TAG_NUMPY_ARRAY = 10
TAG_NUMPY_SCALAR = 11
# 12 is TAG_SURROGATE_STR (above).
TAG_JAGGED = 13
TAG_TENSORDICT = 14
TAG_NON_TENSOR_DATA = 15
TAG_NON_TENSOR_STACK = 16

# The core's bounds (spbcast::limits defaults), checked here first so that the error names the
# Python path: one string or bytes value, and the nesting of containers and objects.
MAX_STRING_BYTES = _C.MAX_STRING_BYTES
# Python levels: an object (and a set, named tuple, OrderedDict, defaultdict) counts twice (it
# travels as a tuple holding a dict or list), and the envelope takes one level.
MAX_DEPTH = (_C.MAX_IVALUE_DEPTH - 2) // 2

INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1


class Kind:
    """The defaults of the contract above: a leaf found by type that rebuilds nothing."""

    types = ()
    decodes = ()
    levels = 2
    as_is = False
    holds_values = False

    def claims(self, cls, value):
        return False

    def check(self, encoder, cls, value, path):
        return self

    def encode(self, encoder, value, path, depth):
        return value

    def decode(self, decoder, value, depth):
        return value


def check_bytes(encoder, value, path):
    """A bytes value within the core's bound on one value (bytes and numpy scalars)."""
    if len(value) > MAX_STRING_BYTES:
        encoder.fail(path, f"bytes of length {len(value)}, over spbcast's limit of "
                           f"{MAX_STRING_BYTES} per value; send large data as a uint8 tensor "
                           "(torch.frombuffer)")

