"""Python objects <-> the tree of values the C++ core carries (its dynamic value, c10::IValue).

The core carries None, bool, int, float, str, tensors, lists, tuples and dicts with str or int
keys. Everything else a batch may hold is written in that vocabulary with tagged tuples, whose
first element says what they are; a user's tuple is one of them too, so no user value can be
mistaken for a tag. Each kind of value - its Python types, its tag, how the root writes it and
how a follower rebuilds it - is stated in one place, as the C++ wire states its kinds
(include/spbcast/detail/wire/):

    kind_traits      the tags, the bounds, the contract of a kind
    kind_scalars     None, bool, float, int, str, bytes, tensors, enum members
    kind_containers  lists, dicts, OrderedDict, defaultdict, sets and frozensets, torch.Size
    kind_records     tuples, named tuples, objects (dataclasses and plain classes)
    kind_numpy       numpy arrays and scalars
    kind_nested      jagged nested tensors (torch.nested); torch_nested, the torch internals read
    kind_tensordict  tensordict's TensorDict, NonTensorData and NonTensorStack
    kinds            the table of kinds the codec dispatches through
    value_codec      the walk over a tree: nesting, cycles, paths, classes resolved once
    field_path       the path an error names; what a follower raises for a refused value
    allow_list       allow_classes() / allow_modules()
    envelope         the envelope around a value or the root's error, its version

The wire carries data, never code: there is no pickle. A follower rebuilds only the built-in
kinds and classes the program allowed with allow_classes() / allow_modules(), which every rank
runs (the same program runs everywhere). The allow-list is consulted before any import, so a
root cannot make a follower import a module or build an object of a class nobody allowed
(tempfile's wrappers, weakref.finalize, ... whose finalizers act); allowed classes are rebuilt
without calling __init__ (object.__new__ and the attributes set), named tuples with
tuple.__new__, enum members by lookup.
"""

from .allow_list import _allowed_classes, allow_classes, allow_modules  # noqa: F401 - tests edit it
from .envelope import (KIND_ERROR, KIND_VALUE, MAGIC, WIRE_VERSION, decode, decode_body, encode,  # noqa: F401
                       error_envelope, open_envelope)
from .kind_traits import (MAX_DEPTH, MAX_STRING_BYTES, TAG_BYTES, TAG_DEFAULTDICT, TAG_ENUM,  # noqa: F401
                          TAG_FROZENSET, TAG_JAGGED, TAG_NAMEDTUPLE, TAG_NON_TENSOR_DATA,
                          TAG_NON_TENSOR_STACK, TAG_NUMPY_ARRAY, TAG_NUMPY_SCALAR, TAG_OBJECT,
                          TAG_ORDERED_DICT, TAG_SET, TAG_SIZE, TAG_SURROGATE_STR, TAG_TENSORDICT,
                          TAG_TUPLE)
