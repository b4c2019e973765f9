"""Python objects <-> the tree of values the C++ core carries (its dynamic value, c10::IValue).

The core carries None, bool, int, float, str, tensors, lists, tuples and dicts with str or int
keys. Everything else a batch may hold is written in that vocabulary with tagged tuples, whose
first element says what they are; a user's tuple is one of them too, so no user value can be
mistaken for a tag:

    (TAG_TUPLE, e0, e1, ...)                    a tuple
    (TAG_BYTES, b"...")                         bytes (the C++ side turns it into bytes)
    (TAG_OBJECT, module, qualname, {name: v})   a dataclass or plain object, rebuilt by class

The wire carries data, never code: an object is named by its class, which each rank imports
itself, and rebuilt without calling ``__init__`` (``object.__new__`` and its attributes set).
"""

import dataclasses
import enum
import functools
import importlib
import json
import sys
import types

import torch

from . import _C
from .errors import Error, SchemaError

TAG_TUPLE = _C.TAG_TUPLE
TAG_BYTES = _C.TAG_BYTES
TAG_OBJECT = _C.TAG_OBJECT

# The envelope around every broadcast value, so that followers know what the root sent: a value
# or the root's error, in which version of this layer.
MAGIC = "spbcast.py"
WIRE_VERSION = 1
KIND_VALUE = 0
KIND_ERROR = 1

# The core's bounds (spbcast::limits defaults), checked here first so that the error names the
# Python path: one string or bytes value, and the nesting of containers and objects.
MAX_STRING_BYTES = _C.MAX_STRING_BYTES
# Python levels: an object counts twice (it travels as a tuple holding a dict), and the
# envelope takes one level.
MAX_DEPTH = (_C.MAX_IVALUE_DEPTH - 2) // 2

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

_CODE_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, types.BuiltinMethodType, functools.partial, types.CodeType,
               types.GeneratorType, types.CoroutineType)
_FIX = {
    set: "send a sorted list instead",
    frozenset: "send a sorted list instead",
    bytearray: "send bytes(...) instead",
    torch.Size: "send tuple(size) instead",
    torch.dtype: "send str(dtype) instead",
    torch.device: "send str(device) instead",
    complex: "send a complex tensor or (real, imag) instead",
}


def _path_text(path):
    # A path is a linked list (parent, segment), formatted only when an error needs it: an int
    # is a list or tuple index, a 1-tuple a dict key, a str a name (the root, an attribute).
    parts = []
    while path is not None:
        path, segment = path
        if type(segment) is int:
            parts.append(f"[{segment}]")
        elif type(segment) is tuple:
            key = segment[0]
            parts.append(f"[{json.dumps(key) if type(key) is str else key}]")
        else:
            parts.append(segment)
    return "".join(reversed(parts))


class _Encoder:
    def __init__(self, rank):
        self.rank = rank
        self.active = set()  # ids of the containers on the current path (cycle detection)
        self.class_ok = {}  # class -> (module, qualname), checked once per class

    def fail(self, path, what):
        raise Error(f"spbcast: rank {self.rank}: cannot send {_path_text(path)}: {what}",
                    "unsupported_value")

    def encode(self, value, path, depth=0):
        t = type(value)
        if value is None or t is bool or t is float:
            return value
        if t is str:
            if len(value) > MAX_STRING_BYTES // 4 and len(value.encode()) > MAX_STRING_BYTES:
                self.fail(path, f"a str of {len(value.encode())} bytes, over spbcast's limit of "
                                f"{MAX_STRING_BYTES} per string; send large data as a uint8 tensor")
            return value
        if t is int:
            if not _INT64_MIN <= value <= _INT64_MAX:
                self.fail(path, f"the int {value} does not fit in 64 bits; send it as a str")
            return value
        if t is torch.Tensor:
            self.check_tensor(value, path)
            return value
        if t is bytes:
            if len(value) > MAX_STRING_BYTES:
                self.fail(path, f"bytes of length {len(value)}, over spbcast's limit of "
                                f"{MAX_STRING_BYTES} per value; send large data as a uint8 tensor "
                                "(torch.frombuffer)")
            return (TAG_BYTES, value)
        if depth >= MAX_DEPTH:
            self.fail(path, f"containers nested deeper than {MAX_DEPTH} levels")
        depth += 1
        if t is list or t is tuple or t is dict:
            key = id(value)
            if key in self.active:
                self.fail(path, "a reference cycle; spbcast sends trees of values")
            self.active.add(key)
            try:
                if t is list:
                    return [self.encode(v, (path, i), depth) for i, v in enumerate(value)]
                if t is tuple:
                    return (TAG_TUPLE,) + tuple(self.encode(v, (path, i), depth)
                                                for i, v in enumerate(value))
                return self.encode_dict(value, path, depth)
            finally:
                self.active.discard(key)
        if isinstance(value, torch.Tensor):
            self.fail(path, f"a tensor of the subclass {t.__module__}.{t.__qualname__}; send a "
                            "plain tensor (t.detach() or t.as_subclass(torch.Tensor))")
        if isinstance(value, _CODE_TYPES):
            self.fail(path, f"a {t.__name__} ({getattr(value, '__qualname__', value)!r}); "
                            "spbcast sends data, never code")
        return self.encode_object(value, path, depth)

    def encode_dict(self, value, path, depth):
        out = {}
        kind = None
        for k, v in value.items():
            kt = type(k)
            if kt is not str and kt is not int:
                self.fail(path, f"a dict key of type {kt.__name__} ({k!r}); keys must be str or int")
            if kind is None:
                kind = kt
            elif kt is not kind:
                self.fail(path, "a dict that mixes str and int keys; use one key type per dict")
            if kt is int and not _INT64_MIN <= k <= _INT64_MAX:
                self.fail(path, f"the dict key {k} does not fit in 64 bits")
            out[k] = self.encode(v, (path, (k,)), depth)
        return out

    def encode_object(self, value, path, depth):
        cls = type(value)
        name = self.class_ok.get(cls)
        if name is None:
            name = self.check_class(cls, value, path)
            self.class_ok[cls] = name
        key = id(value)
        if key in self.active:
            self.fail(path, "a reference cycle; spbcast sends trees of values")
        self.active.add(key)
        try:
            state = {}
            if dataclasses.is_dataclass(value):
                for f in dataclasses.fields(value):
                    state[f.name] = getattr(value, f.name)
            if hasattr(value, "__dict__"):
                state.update(vars(value))
            fields = {}
            for k, v in state.items():
                if type(k) is not str:
                    self.fail(path, f"an attribute name {k!r} that is not a str")
                fields[k] = self.encode(v, (path, "." + k), depth + 1)
        finally:
            self.active.discard(key)
        return (TAG_OBJECT, name[0], name[1], fields)

    def check_class(self, cls, value, path):
        what = f"{cls.__module__}.{cls.__qualname__}"
        if cls in _FIX:
            self.fail(path, f"a {cls.__name__}, which spbcast does not send; {_FIX[cls]}")
        if isinstance(value, enum.Enum):
            self.fail(path, f"the enum member {value!r}; send its .value or .name")
        if cls.__module__.split(".")[0] == "numpy":
            self.fail(path, f"a numpy {cls.__name__}; send torch.from_numpy(a) for an array, "
                            "x.item() for a scalar")
        if issubclass(cls, (list, tuple, dict, str, bytes, int, float)):
            self.fail(path, f"an instance of {what}, a subclass of a built-in type; convert it to "
                            "the plain type (list, tuple, dict, str, bytes, int, float)")
        if cls.__new__ is not object.__new__:
            self.fail(path, f"an instance of {what}, whose class defines __new__ (or derives from "
                            "a built-in type); spbcast rebuilds objects with object.__new__ and "
                            "sends dataclasses and plain classes only")
        if not dataclasses.is_dataclass(value):
            if not hasattr(value, "__dict__"):
                self.fail(path, f"an instance of {what}, which has no __dict__ and is no dataclass")
            for klass in cls.__mro__:
                slots = klass.__dict__.get("__slots__", ())
                slots = (slots,) if isinstance(slots, str) else slots
                if any(s not in ("__dict__", "__weakref__") for s in slots):
                    self.fail(path, f"an instance of {what}, whose class has __slots__; make it a "
                                    "dataclass or a plain class")
        if "<locals>" in cls.__qualname__:
            self.fail(path, f"an instance of {what}, a class defined inside a function; define it "
                            "at module level so that every rank can import it")
        try:
            found = _resolve_class(cls.__module__, cls.__qualname__)
        except Exception as e:  # noqa: BLE001 - any failure means: not importable
            found = e
        if found is not cls:
            self.fail(path, f"an instance of {what}, which cannot be found again by its module and "
                            "name; every rank must be able to import the class")
        return (cls.__module__, cls.__qualname__)

    def check_tensor(self, t, path):
        if t.device.type != "cpu":
            self.fail(path, f"a tensor on {t.device}; spbcast sends CPU tensors, so move it to the "
                            "CPU in the collator (.cpu())")
        if t.layout != torch.strided or t.is_nested:
            kind = "nested" if t.is_nested else str(t.layout).replace("torch.", "")
            self.fail(path, f"a {kind} tensor; spbcast sends dense strided tensors (convert it, "
                            "e.g. t.to_dense())")
        if not _C.dtype_supported(t):
            self.fail(path, f"a tensor of dtype {t.dtype}, which spbcast does not send")


def _resolve_class(module, qualname):
    mod = sys.modules.get(module)
    if mod is None:
        mod = importlib.import_module(module)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def encode(value, rank, name="batch"):
    """The root's value as an envelope for the core; raises spbcast.Error naming the path,
    which starts with `name`."""
    body = _Encoder(rank).encode(value, (None, name))
    return (MAGIC, WIRE_VERSION, KIND_VALUE, body)


def error_envelope(error):
    return (MAGIC, WIRE_VERSION, KIND_ERROR, str(error), error.code)


class _Decoder:
    def __init__(self, rank):
        self.rank = rank
        self.classes = {}

    def decode(self, value):
        t = type(value)
        if t is list:
            for i, v in enumerate(value):
                value[i] = self.decode(v)
            return value
        if t is dict:
            for k, v in value.items():
                value[k] = self.decode(v)
            return value
        if t is tuple:
            tag = value[0] if value else None
            if tag == TAG_TUPLE:
                return tuple(self.decode(v) for v in value[1:])
            if (tag == TAG_OBJECT and len(value) == 4 and type(value[1]) is str
                    and type(value[2]) is str and type(value[3]) is dict
                    and all(type(k) is str for k in value[3])):
                return self.rebuild(value[1], value[2], value[3])
            raise SchemaError(f"spbcast: rank {self.rank}: the root sent a tuple this version of "
                              f"the spbcast package cannot read (tag {tag!r})", "corrupt_frame")
        return value

    def rebuild(self, module, qualname, fields):
        cls = self.classes.get((module, qualname))
        if cls is None:
            try:
                cls = _resolve_class(module, qualname)
            except Exception as e:  # noqa: BLE001
                raise SchemaError(f"spbcast: rank {self.rank}: the root sent an instance of "
                                  f"{module}.{qualname}, which this rank cannot import: {e}",
                                  "schema_mismatch", "", f"{module}.{qualname}") from e
            if not isinstance(cls, type) or cls.__new__ is not object.__new__:
                raise SchemaError(f"spbcast: rank {self.rank}: the root sent an instance of "
                                  f"{module}.{qualname}, which is not a plain class or dataclass "
                                  "on this rank", "schema_mismatch", "", f"{module}.{qualname}")
            self.classes[(module, qualname)] = cls
        obj = object.__new__(cls)
        values = {k: self.decode(v) for k, v in fields.items()}
        d = getattr(obj, "__dict__", None)
        if d is not None and not hasattr(cls, "__slots__"):
            d.update(values)
        else:
            for k, v in values.items():  # a slotted dataclass (frozen ones too)
                object.__setattr__(obj, k, v)
        return obj


def decode(envelope, rank, root_rank):
    """The root's value from its envelope, or the root's error raised as spbcast.RemoteError."""
    from .errors import RemoteError

    if (type(envelope) is not tuple or len(envelope) < 4 or envelope[0] != MAGIC):
        raise SchemaError(f"spbcast: rank {rank}: the root did not send a value of the spbcast "
                          "Python package (is the root calling spbcast.broadcast from Python?)",
                          "schema_mismatch")
    if envelope[1] != WIRE_VERSION:
        raise SchemaError(f"spbcast: rank {rank}: the root's spbcast Python package writes wire "
                          f"version {envelope[1]}, this rank reads version {WIRE_VERSION}; install "
                          "the same spbcast on every rank", "version_mismatch",
                          str(WIRE_VERSION), str(envelope[1]))
    if envelope[2] == KIND_ERROR:
        message, _code = envelope[3], envelope[4]
        raise RemoteError(f"spbcast: rank {rank}: the root (rank {root_rank}) failed before "
                          f"sending: {message}", "remote", root_rank, message)
    return _Decoder(rank).decode(envelope[3])
