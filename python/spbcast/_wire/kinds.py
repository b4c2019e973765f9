"""The table of kinds (as C++ detail/wire/kinds.hpp): every kind once, and the lookups the codec
dispatches through, built from it. A new kind is a Kind in one of the kind_* modules (its
types, its tag, its encode and decode side by side) and one line in KINDS."""

import functools
import types

import torch

from .kind_containers import DefaultDict, Map, OrderedDict, Sequence, Set, Size
from .kind_nested import JaggedNested
from .kind_numpy import NumpyArray, NumpyScalar
from .kind_records import NamedTuple, Object, Tuple
from .kind_scalars import AsIs, Bytes, Enumeration, Integer, String, Tensor
from .kind_tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictOther
from .kind_traits import Kind

_CODE_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, types.BuiltinMethodType, functools.partial, types.CodeType,
               types.GeneratorType, types.CoroutineType)
_FIX = {
    bytearray: "send bytes(...) instead",
    torch.dtype: "send str(dtype) instead",
    torch.device: "send str(device) instead",
    complex: "send a complex tensor or (real, imag) instead",
}


class Unsupported(Kind):
    """Values the wire refuses before any other kind looks at their class, with what to send
    instead: tensor subclasses, code (the wire carries data, never code: there is no pickle)
    and a few types with a plain equivalent."""

    def claims(self, cls, value):
        return isinstance(value, torch.Tensor) or isinstance(value, _CODE_TYPES) or cls in _FIX

    def check(self, encoder, cls, value, path):
        if isinstance(value, torch.Tensor):
            encoder.fail(path, f"a tensor of the subclass {cls.__module__}.{cls.__qualname__}; send "
                               "a plain tensor (t.detach() or t.as_subclass(torch.Tensor))")
        if isinstance(value, _CODE_TYPES):
            encoder.fail(path, f"a {cls.__name__} ({getattr(value, '__qualname__', value)!r}); "
                               "spbcast sends data, never code")
        encoder.fail(path, f"a {cls.__name__}, which spbcast does not send; {_FIX[cls]}")


# Kinds found by type first, then - for a class no type names - the class kinds in priority
# order: the first that claims a class is its kind, and Object claims whatever is left.
KINDS = (AsIs(), Integer(), String(), Bytes(), Tensor(), Sequence(), Tuple(), Map(), Set(), Size(),
         OrderedDict(), DefaultDict(), JaggedNested(), Unsupported(), NumpyArray(), NumpyScalar(),
         TensorDict(), NonTensorData(), NonTensorStack(), TensorDictOther(), Enumeration(), NamedTuple(),
         Object())

BY_TYPE = {t: kind for kind in KINDS for t in kind.types}
AS_IS = frozenset(t for kind in KINDS if kind.as_is for t in kind.types)
# The encode of each kind whose values are leaves the core carries (levels 0: no nesting bound).
LEAVES = {t: kind.encode for t, kind in BY_TYPE.items() if not kind.levels and not kind.as_is}
BY_WIRE = {key: kind for kind in KINDS for key in kind.decodes}
CLASS_KINDS = tuple(kind for kind in KINDS if type(kind).claims is not Kind.claims)
assert len(BY_TYPE) == sum(len(kind.types) for kind in KINDS), "a type named by two kinds"
assert len(BY_WIRE) == sum(len(kind.decodes) for kind in KINDS), "a tag decoded by two kinds"
assert isinstance(CLASS_KINDS[-1], Object), "the last class kind claims every class"
