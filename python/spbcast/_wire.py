"""Python objects <-> the tree of values the C++ core carries (its dynamic value, c10::IValue).

The core carries None, bool, int, float, str, tensors, lists, tuples and dicts with str or int
keys. Everything else a batch may hold is written in that vocabulary with tagged tuples, whose
first element says what they are; a user's tuple is one of them too, so no user value can be
mistaken for a tag:

    (TAG_TUPLE, e0, e1, ...)                     a tuple
    (TAG_BYTES, b"...")                          bytes (the C++ side turns it into bytes)
    (TAG_OBJECT, module, qualname, {name: v})    a dataclass or plain object of an allowed class
    (TAG_SET, [e...]) / (TAG_FROZENSET, [e...])  a set / frozenset, elements in a canonical order
    (TAG_ENUM, module, qualname, name)           an enum member of an allowed class (a composite
    (TAG_ENUM, module, qualname, None, value)      Flag travels by its int value)
    (TAG_NAMEDTUPLE, module, qualname, [v...])   a named tuple of an allowed class
    (TAG_SIZE, [d...])                           a torch.Size
    (TAG_ORDERED_DICT, {k: v})                   a collections.OrderedDict (order kept)
    (TAG_DEFAULTDICT, factory, {k: v})           a collections.defaultdict; factory is None, the
                                                   name of a built-in type or [module, qualname]
                                                   of an allowed class
    (TAG_NUMPY_ARRAY, dtype, [shape], tensor)    a numpy array: its bytes as a flat uint8 tensor
    (TAG_NUMPY_SCALAR, dtype, b"...")            a numpy scalar: its bytes
    (TAG_SURROGATE_STR, b"...")                  a str that is not valid UTF-8 (lone
                                                   surrogates): its "surrogatepass" bytes (the
                                                   C++ side makes and reads it)

The wire carries data, never code: there is no pickle. A follower rebuilds only the built-in
kinds above and classes the program allowed with allow_classes() / allow_modules(), which every
rank runs (the same program runs everywhere). The allow-list is consulted before any import, so
a root cannot make a follower import a module or build an object of a class nobody allowed
(tempfile's wrappers, weakref.finalize, ... whose finalizers act); allowed classes are rebuilt
without calling __init__ (object.__new__ and the attributes set), named tuples with
tuple.__new__, enum members by lookup.
"""

import collections
import contextlib
import dataclasses
import enum
import functools
import importlib
import json
import re
import sys
import types
import warnings

import torch

from . import _C
from .errors import Error, SchemaError

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

# The envelope around every broadcast value, so that followers know what the root sent: a value
# or the root's error, in which version of this layer. Version 2 added the tags from TAG_SET on
# and the allow-list; 3 the tagged form of a str that is not UTF-8 (TAG_SURROGATE_STR).
MAGIC = "spbcast.py"
WIRE_VERSION = 3
KIND_VALUE = 0
KIND_ERROR = 1

# The core's bounds (spbcast::limits defaults), checked here first so that the error names the
# Python path: one string or bytes value, and the nesting of containers and objects.
MAX_STRING_BYTES = _C.MAX_STRING_BYTES
# Python levels: an object (and a set, named tuple, OrderedDict, defaultdict) counts twice (it
# travels as a tuple holding a dict or list), and the envelope takes one level.
MAX_DEPTH = (_C.MAX_IVALUE_DEPTH - 2) // 2

_INT64_MIN = -(2**63)
_INT64_MAX = 2**63 - 1

_CODE_TYPES = (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
               types.MethodType, types.BuiltinMethodType, functools.partial, types.CodeType,
               types.GeneratorType, types.CoroutineType)
_FIX = {
    bytearray: "send bytes(...) instead",
    torch.dtype: "send str(dtype) instead",
    torch.device: "send str(device) instead",
    complex: "send a complex tensor or (real, imag) instead",
}
# The default_factory values a defaultdict may have besides None and allowed classes: built-in
# types, rebuilt by this fixed table (a name on the wire, never an import).
_FACTORIES = {f.__name__: f for f in (list, dict, set, frozenset, tuple, int, float, str, bool,
                                      bytes, collections.OrderedDict)}
# numpy dtypes sent: bool, integers, floats, complex, timedelta, datetime, bytes, str, raw void.
# Object and structured dtypes hold Python objects or fields, which raw bytes do not rebuild.
_NUMPY_KINDS = "biufcmMSUV"
_NUMPY_DTYPE = re.compile(r"[<>|=][biufcmMSUV][0-9]{0,6}(\[[0-9]*[a-zA-Z]{1,3}\])?")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---- the allow-list ---------------------------------------------------------------------------

_allowed_classes = {}  # (module, qualname) -> the class allow_classes registered
_allowed_modules = {}  # module prefix allow_modules registered -> whether it may be imported


def allow_classes(*classes):
    """Lets spbcast send and rebuild instances of these classes: dataclasses, plain classes,
    enums (their members) and named tuples. Call it on every rank - at import time, next to the
    classes, is simplest: the root and the followers run the same program. Returns its argument
    when given one class, so it also works as a class decorator (put it outermost:
    ``@dataclass(slots=True)`` makes a new class)."""
    for cls in classes:
        if not isinstance(cls, type):
            raise Error(f"spbcast.allow_classes: {cls!r} is not a class", "invalid_argument")
        if "<locals>" in cls.__qualname__:
            raise Error(f"spbcast.allow_classes: {cls.__module__}.{cls.__qualname__} is defined "
                        "inside a function; define it at module level so that every rank can "
                        "find it by its module and name", "invalid_argument")
        _allowed_classes[(cls.__module__, cls.__qualname__)] = cls
    return classes[0] if len(classes) == 1 else None


def allow_modules(*prefixes, allow_import=False):
    """Lets spbcast send and rebuild instances of every class defined in these modules and their
    submodules ("mypkg" allows mypkg and mypkg.data.x, not mypkgx). Call it on every rank, as
    allow_classes.

    A follower rebuilds such a class only from a module its own program has already imported
    (as it has where the datasets are built on every rank): a root never makes it run a
    module's code. With ``allow_import=True`` a follower also imports a module it lacks - only
    a real module under these prefixes, named by its canonical dotted name (no ``__main__`` or
    ``__init__`` segment), whose top-level code then runs on that follower."""
    names = []
    for p in prefixes:
        name = p.__name__ if isinstance(p, types.ModuleType) else p
        if type(name) is not str or _module_name_problem(name) is not None:
            raise Error(f"spbcast.allow_modules: {p!r} is not a module name (e.g. \"mypkg\" or "
                        "\"mypkg.data\")", "invalid_argument")
        names.append(name)
    for name in names:
        _allowed_modules[name] = _allowed_modules.get(name, False) or bool(allow_import)


def _module_name_problem(module):
    """Why `module` is not a canonical absolute dotted module name, or None. __main__ (the
    program's own script, always imported) is the one dunder name allowed."""
    if module == "__main__":
        return None
    for segment in module.split("."):
        if not _NAME.fullmatch(segment):
            return "an empty, relative or invalid segment"
        if segment.startswith("__") and segment.endswith("__"):
            return f"the segment {segment}"
    return None


def _module_rule(module):
    """None when no allow_modules prefix covers `module`, else whether it may be imported."""
    found = None
    for p, may_import in _allowed_modules.items():
        if module == p or module.startswith(p + "."):
            found = found or may_import
    return found


def _allow_hint(module, qualname):
    return (f"call spbcast.allow_classes({module}.{qualname}) (or spbcast.allow_modules("
            f"{module.split('.')[0]!r})) on every rank, e.g. where the class is defined")


class _NotAllowed(Exception):
    """A class name the program did not allow; the message (if any) says what to do."""


def _allowed_class(module, qualname):
    """The class allowed under this name. Raises _NotAllowed (before any import) when neither
    allow_classes nor allow_modules allowed it or the name is refused, any other exception when
    an allowed module cannot give it."""
    cls = _allowed_classes.get((module, qualname))
    if cls is not None:
        return cls
    rule = _module_rule(module)
    if rule is None:
        raise _NotAllowed()
    problem = _module_name_problem(module)
    if problem is not None:
        raise _NotAllowed(f"a module name with {problem}, which spbcast never looks up; a class "
                          "travels under its module's canonical dotted name")
    parts = qualname.split(".")
    if not all(_NAME.fullmatch(p) and not p.startswith("__") for p in parts):
        raise _NotAllowed(f"{qualname!r} is not the qualified name of a class")
    mod = sys.modules.get(module)
    if mod is None:
        if not rule:
            raise _NotAllowed(
                f"its module {module} is not imported on this rank, and spbcast imports nothing "
                f"a root names unless told to; import {module} on every rank (where the datasets "
                f"are built), or let followers import it: spbcast.allow_modules("
                f"{module.split('.')[0]!r}, allow_import=True)")
        mod = importlib.import_module(module)
    if getattr(mod, "__name__", None) != module:
        raise _NotAllowed(f"{module} resolves to another module ({getattr(mod, '__name__', mod)!r}) "
                          "on this rank; a class travels under its module's canonical name")
    obj = mod
    for part in parts:
        obj = getattr(obj, part)
    if not isinstance(obj, type) or obj.__module__ != module or obj.__qualname__ != qualname:
        raise LookupError(f"{module}.{qualname} is not a class defined in {module} (it names "
                          f"{obj!r})")
    return obj


# ---- paths ------------------------------------------------------------------------------------

def _path_text(path):
    # A path is a linked list (parent, segment), formatted only when an error needs it: an int
    # is a list or tuple index, a 1-tuple a dict key, a str a name (the root, an attribute, a
    # set element "{i}" in the set's sent order).
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


def _set_key(v):
    """A key that orders set elements the same way in every process (a set of str iterates in
    an order that depends on the process's hash seed), or None for an element spbcast does not
    put in sets. Keys of different kinds differ in their first item, so any two compare."""
    t = type(v)
    if v is None:
        return (0,)
    if t is bool:
        return (1, v)
    if t is int or t is float:
        return (2, v != v, 0 if v != v else v)  # NaN last (it compares with nothing)
    if t is str:
        return (3, v)
    if t is bytes:
        return (4, v)
    if isinstance(v, enum.Enum):
        return (5, t.__module__, t.__qualname__, str(v))
    if isinstance(v, tuple) and (t is tuple or _is_namedtuple(t)):
        keys = tuple(_set_key(x) for x in v)
        return None if None in keys else (6, "" if t is tuple else t.__qualname__, keys)
    if t is frozenset:
        keys = [_set_key(x) for x in v]
        return None if None in keys else (7, tuple(sorted(keys)))
    return None


def _utf8_size(text):
    # Lone surrogates (os.fsdecode of a name that is not UTF-8) travel as the 3 bytes
    # "surrogatepass" gives them.
    return len(text.encode("utf-8", "surrogatepass"))


def _is_utf8(text):
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def _is_namedtuple(cls):
    return issubclass(cls, tuple) and type(getattr(cls, "_fields", None)) is tuple


# ---- the root: encoding -----------------------------------------------------------------------

class _Encoder:
    def __init__(self, rank):
        self.rank = rank
        self.active = set()  # ids of the containers on the current path (cycle detection)
        self.class_ok = {}  # class -> (encode method, module, qualname), checked once per class
        self.arrays = {}  # id(numpy array) -> (array, tensor): an array sent twice is one tensor

    def fail(self, path, what):
        raise Error(f"spbcast: rank {self.rank}: cannot send {_path_text(path)}: {what}",
                    "unsupported_value")

    def encode(self, value, path, depth=0):
        t = type(value)
        if value is None or t is bool or t is float:
            return value
        if t is str:
            if len(value) > MAX_STRING_BYTES // 4 and _utf8_size(value) > MAX_STRING_BYTES:
                self.fail(path, f"a str of {_utf8_size(value)} bytes, over spbcast's limit of "
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
            self.check_bytes(value, path)
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
        builtin = _BUILTIN_KINDS.get(t)
        if builtin is not None:
            return builtin(self, value, path, depth + 1)
        if isinstance(value, torch.Tensor):
            self.fail(path, f"a tensor of the subclass {t.__module__}.{t.__qualname__}; send a "
                            "plain tensor (t.detach() or t.as_subclass(torch.Tensor))")
        if isinstance(value, _CODE_TYPES):
            self.fail(path, f"a {t.__name__} ({getattr(value, '__qualname__', value)!r}); "
                            "spbcast sends data, never code")
        kind = self.class_ok.get(t)
        if kind is None:
            kind = self.class_ok[t] = self.check_class(t, value, path)
        method, module, qualname = kind
        return method(self, value, module, qualname, path, depth + 1)

    @contextlib.contextmanager
    def on_path(self, value, path):
        # The containers and objects on the current path: meeting one again is a cycle.
        key = id(value)
        if key in self.active:
            self.fail(path, "a reference cycle; spbcast sends trees of values")
        self.active.add(key)
        try:
            yield
        finally:
            self.active.discard(key)

    def check_bytes(self, value, path):
        if len(value) > MAX_STRING_BYTES:
            self.fail(path, f"bytes of length {len(value)}, over spbcast's limit of "
                            f"{MAX_STRING_BYTES} per value; send large data as a uint8 tensor "
                            "(torch.frombuffer)")

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
            if kt is str and not k.isascii() and not _is_utf8(k):
                self.fail(path, f"the dict key {k!r}, a str that is not valid UTF-8 (lone "
                                "surrogates); spbcast sends such strs as values, not as keys: "
                                "send the key os.fsencode()d or as bytes")
            out[k] = self.encode(v, (path, (k,)), depth)
        return out

    # -- the built-in kinds, no registration needed --

    def encode_set(self, value, path, depth):
        keyed = []
        for v in value:
            key = _set_key(v)
            if key is None:
                self.fail(path, f"a {type(value).__name__} holding a {type(v).__name__} ({v!r:.60}); "
                                "spbcast sends sets of None, bool, int, float, str, bytes, enum "
                                "members and tuples or frozensets of them")
            keyed.append((key, v))
        keyed.sort(key=lambda kv: kv[0])
        tag = TAG_SET if type(value) is set else TAG_FROZENSET
        return (tag, [self.encode(v, (path, f"{{{i}}}"), depth) for i, (_, v) in enumerate(keyed)])

    def encode_size(self, value, path, depth):
        return (TAG_SIZE, [int(d) for d in value])

    def encode_ordered_dict(self, value, path, depth):
        with self.on_path(value, path):
            return (TAG_ORDERED_DICT, self.encode_dict(value, path, depth))

    def encode_defaultdict(self, value, path, depth):
        factory = value.default_factory
        if factory is None:
            spec = None
        elif _FACTORIES.get(getattr(factory, "__name__", None)) is factory:
            spec = factory.__name__
        elif isinstance(factory, type) and self.class_allowed(factory):
            spec = [factory.__module__, factory.__qualname__]
        else:
            self.fail(path, f"a defaultdict whose default_factory is {factory!r}; spbcast rebuilds "
                            "a defaultdict only with no factory, a built-in type ("
                            f"{', '.join(_FACTORIES)}) or an allowed class (spbcast.allow_classes); "
                            "send dict(d), or use one of those factories")
        with self.on_path(value, path):
            return (TAG_DEFAULTDICT, spec, self.encode_dict(value, path, depth))

    # -- classes: checked once per class --

    def check_class(self, cls, value, path):
        what = f"{cls.__module__}.{cls.__qualname__}"
        if cls in _FIX:
            self.fail(path, f"a {cls.__name__}, which spbcast does not send; {_FIX[cls]}")
        np = sys.modules.get("numpy")  # a numpy value means numpy is imported: never import it
        if np is not None and isinstance(value, (np.ndarray, np.generic)):
            return self.check_numpy(np, cls, value, path)
        if isinstance(value, enum.Enum):
            self.check_allowed(cls, path, "the enum")
            return (_Encoder.encode_enum, cls.__module__, cls.__qualname__)
        if _is_namedtuple(cls):
            if "<locals>" in cls.__qualname__:
                self.fail(path, f"a {what}, a named tuple defined inside a function; define it at "
                                "module level so that every rank can find it")
            self.check_allowed(cls, path, "the named tuple")
            return (_Encoder.encode_namedtuple, cls.__module__, cls.__qualname__)
        if issubclass(cls, (list, tuple, dict, set, frozenset, str, bytes, int, float)):
            self.fail(path, f"an instance of {what}, a subclass of a built-in type; convert it to "
                            "the plain type (list, tuple, dict, set, str, bytes, int, float)")
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
        self.check_allowed(cls, path, "an instance of")
        return (_Encoder.encode_plain, cls.__module__, cls.__qualname__)

    def class_allowed(self, cls):
        try:
            return _allowed_class(cls.__module__, cls.__qualname__) is cls
        except Exception:  # noqa: BLE001 - not allowed, or not found again: either way, no
            return False

    def check_allowed(self, cls, path, what):
        # Checked on the root too, so that a class the program forgot to allow is one clear
        # error on every rank (the followers check again for themselves).
        module, qualname = cls.__module__, cls.__qualname__
        try:
            found = _allowed_class(module, qualname)
        except _NotAllowed as e:
            self.fail(path, f"{what} {module}.{qualname}, " + (str(e) or (
                "a class spbcast rebuilds only when the program allows it; "
                + _allow_hint(module, qualname))))
        except Exception as e:  # noqa: BLE001 - any failure means: not found again
            found = e
        if found is not cls:
            self.fail(path, f"{what} {module}.{qualname}, which cannot be found again by its "
                            "module and name (a class allowed under that name is another class "
                            "object, e.g. one a decorator replaced, or the module does not "
                            "define it); allow the final class, defined at module level")

    def encode_plain(self, value, module, qualname, path, depth):
        with self.on_path(value, path):
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
                fields[k] = self.encode(v, (path, "." + k), depth)
        return (TAG_OBJECT, module, qualname, fields)

    def encode_enum(self, value, module, qualname, path, depth):
        cls = type(value)
        if value.name is not None and cls.__members__.get(value.name) is value:
            return (TAG_ENUM, module, qualname, value.name)
        if isinstance(value, enum.Flag) and type(value.value) is int \
                and _INT64_MIN <= value.value <= _INT64_MAX:
            return (TAG_ENUM, module, qualname, None, value.value)  # a composite flag
        self.fail(path, f"the enum member {value!r}, which is neither a named member nor an int "
                        "Flag; send its .value")

    def encode_namedtuple(self, value, module, qualname, path, depth):
        if getattr(value, "__dict__", None):
            self.fail(path, f"a {module}.{qualname} with attributes besides its fields "
                            f"({sorted(vars(value))}); spbcast sends a named tuple's fields only")
        with self.on_path(value, path):
            return (TAG_NAMEDTUPLE, module, qualname,
                    [self.encode(v, (path, "." + f), depth) for f, v in zip(type(value)._fields, value)])

    # -- numpy (imported by the program, never by spbcast on the root) --

    def check_numpy(self, np, cls, value, path):
        what = f"{cls.__module__}.{cls.__qualname__}"
        exact = cls is np.ndarray or (isinstance(value, np.generic) and cls is value.dtype.type)
        if not exact:
            self.fail(path, f"an instance of {what}, a subclass of a numpy type; send "
                            "np.asarray(a) (or a plain numpy scalar)")
        dt = value.dtype
        if dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.fields is not None \
                or dt.subdtype is not None or not _NUMPY_DTYPE.fullmatch(dt.str):
            self.fail(path, f"a numpy {'array' if cls is np.ndarray else 'scalar'} of dtype {dt}; "
                            "spbcast sends numpy values of bool, integer, float, complex, datetime, "
                            "timedelta, bytes and str dtypes (send each field of a structured "
                            "array as its own array; convert object arrays)")
        method = _Encoder.encode_ndarray if cls is np.ndarray else _Encoder.encode_npscalar
        return (method, "numpy", cls.__qualname__)

    def encode_ndarray(self, value, module, qualname, path, depth):
        seen = self.arrays.get(id(value))
        if seen is None:
            np = sys.modules["numpy"]
            flat = np.ascontiguousarray(value).reshape(-1)
            if flat.nbytes == 0:
                tensor = torch.empty(0, dtype=torch.uint8)
            else:
                with warnings.catch_warnings():  # a read-only array: the root only reads it
                    warnings.simplefilter("ignore", UserWarning)
                    tensor = torch.from_numpy(flat.view(np.uint8))
            seen = self.arrays[id(value)] = (value, tensor)  # holds value: its id stays its own
        return (TAG_NUMPY_ARRAY, value.dtype.str, [int(d) for d in value.shape], seen[1])

    def encode_npscalar(self, value, module, qualname, path, depth):
        data = value.tobytes()
        self.check_bytes(data, path)
        return (TAG_NUMPY_SCALAR, value.dtype.str, (TAG_BYTES, data))

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


_BUILTIN_KINDS = {
    set: _Encoder.encode_set,
    frozenset: _Encoder.encode_set,
    torch.Size: _Encoder.encode_size,
    collections.OrderedDict: _Encoder.encode_ordered_dict,
    collections.defaultdict: _Encoder.encode_defaultdict,
}


def encode(value, rank, name="batch"):
    """The root's value as an envelope for the core; raises spbcast.Error naming the path,
    which starts with `name`."""
    body = _Encoder(rank).encode(value, (None, name))
    return (MAGIC, WIRE_VERSION, KIND_VALUE, body)


def error_envelope(error):
    return (MAGIC, WIRE_VERSION, KIND_ERROR, str(error), error.code)


# ---- a follower: decoding ---------------------------------------------------------------------

class _Refused(Exception):
    """A value this rank will not or cannot rebuild. Each container it passes through on the
    way out adds its segment, so the path costs nothing unless something is refused."""

    def __init__(self, message, code="schema_mismatch", root_schema=""):
        super().__init__(message)
        self.message, self.code, self.root_schema = message, code, root_schema
        self.segments = []  # innermost first


def _corrupt(what):
    return _Refused(f"the root sent {what}, which this version of the spbcast package cannot "
                    "read (is the same spbcast installed on every rank?)", "corrupt_frame")


def _is_str_dict(v):
    return type(v) is dict and all(type(k) is str for k in v)


class _Decoder:
    def __init__(self, rank):
        self.rank = rank
        self.classes = {}  # (module, qualname, kind) -> class, resolved once per broadcast
        self.arrays = {}  # (id(tensor), dtype, shape) -> numpy array: an array sent once is one
        self.handlers = {TAG_OBJECT: self.object_, TAG_SET: self.set_,
                         TAG_FROZENSET: self.set_, TAG_ENUM: self.enum_,
                         TAG_NAMEDTUPLE: self.namedtuple_, TAG_SIZE: self.size_,
                         TAG_ORDERED_DICT: self.dict_kind_, TAG_DEFAULTDICT: self.dict_kind_,
                         TAG_NUMPY_ARRAY: self.ndarray_, TAG_NUMPY_SCALAR: self.npscalar_}

    def decode(self, value, depth=0):
        # One Python frame per level of nesting, and the encoder's count of levels (MAX_DEPTH,
        # an object or other tagged kind counting twice), so whatever the core passes either
        # decodes or is refused here - never a RecursionError.
        t = type(value)
        if t is not list and t is not dict and t is not tuple:
            return value
        if depth >= MAX_DEPTH:
            raise _corrupt(f"containers nested deeper than {MAX_DEPTH} levels")
        if t is list:
            i = 0
            try:
                for i, v in enumerate(value):
                    value[i] = self.decode(v, depth + 1)
            except _Refused as e:
                e.segments.append(i)
                raise
            return value
        if t is dict:
            return self.entries(value, depth + 1)
        tag = value[0] if value and type(value[0]) is int else None
        if tag == TAG_TUPLE:
            return tuple(self.elements(value[1:], depth + 1))
        handler = self.handlers.get(tag)
        if handler is None:
            raise _corrupt(f"a tuple with the tag {tag!r}")
        return handler(value, depth + 2)

    def entries(self, value, depth):
        """A dict's values decoded in place, at `depth`."""
        k = None
        try:
            for k, v in value.items():
                value[k] = self.decode(v, depth)
        except _Refused as e:
            e.segments.append((k,))
            raise
        return value

    def elements(self, values, depth, segment=lambda i: i):
        out = []
        try:
            for v in values:
                out.append(self.decode(v, depth))
        except _Refused as e:
            e.segments.append(segment(len(out)))
            raise
        return out

    def cls(self, module, qualname, what, check):
        """The allowed class the root named, checked to be of the kind `check` accepts; refused
        before any import when the program did not allow it."""
        key = (module, qualname, what)  # per kind: an enum allowed as such is no plain class
        cls = self.classes.get(key)
        if cls is not None:
            return cls
        name = f"{module}.{qualname}"
        try:
            cls = _allowed_class(module, qualname)
        except _NotAllowed as e:
            why = str(e) or ("a class this rank rebuilds only when the program allows it; "
                             + _allow_hint(module, qualname))
            raise _Refused(f"the root sent {what} {name}, {why}", "schema_mismatch", name) from None
        except Exception as e:  # noqa: BLE001 - an allowed module that cannot give the class
            raise _Refused(f"the root sent {what} {name}, which this rank cannot import: "
                           f"{type(e).__name__}: {e}", "schema_mismatch", name) from e
        if not check(cls):
            raise _Refused(f"the root sent {what} {name}, which is not a class of that kind on "
                           "this rank (is the same program running on every rank?)",
                           "schema_mismatch", name)
        self.classes[key] = cls
        return cls

    def object_(self, value, depth):
        if not (len(value) == 4 and type(value[1]) is str and type(value[2]) is str
                and _is_str_dict(value[3])):
            raise _corrupt("a malformed object")
        cls = self.cls(value[1], value[2], "an instance of",
                       lambda c: c.__new__ is object.__new__ and not _is_namedtuple(c))
        fields = value[3]
        obj = object.__new__(cls)
        values = {}
        k = None
        try:
            for k, v in fields.items():
                values[k] = self.decode(v, depth)
        except _Refused as e:
            e.segments.append("." + k)
            raise
        d = getattr(obj, "__dict__", None)
        if d is not None and not hasattr(cls, "__slots__"):
            d.update(values)
        else:
            # A slotted dataclass (frozen ones too): only its fields are set - a name like
            # __class__ is not an attribute to assign.
            names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
            for k, v in values.items():
                if k not in names:
                    raise _Refused(f"the root sent an attribute {k!r} of {value[1]}.{value[2]}, "
                                   "which is not one of its fields on this rank",
                                   "schema_mismatch", f"{value[1]}.{value[2]}")
                object.__setattr__(obj, k, v)
        return obj

    def set_(self, value, depth):
        if len(value) != 2 or type(value[1]) is not list:
            raise _corrupt("a malformed set")
        elements = self.elements(value[1], depth, lambda i: f"{{{i}}}")
        try:
            return set(elements) if value[0] == TAG_SET else frozenset(elements)
        except TypeError:  # an unhashable element: no root of this version sends one
            raise _corrupt("a set holding an unhashable value") from None

    def enum_(self, value, depth):
        if not (len(value) in (4, 5) and type(value[1]) is str and type(value[2]) is str):
            raise _corrupt("a malformed enum member")
        cls = self.cls(value[1], value[2], "a member of the enum",
                       lambda c: issubclass(c, enum.Enum))
        if len(value) == 4 and type(value[3]) is str:
            member = cls.__members__.get(value[3])
            if member is None:
                raise _Refused(f"the root sent the member {value[3]!r} of {value[1]}.{value[2]}, "
                               "which this rank's enum does not have", "schema_mismatch",
                               f"{value[1]}.{value[2]}")
            return member
        if len(value) == 5 and value[3] is None and type(value[4]) is int and issubclass(cls, enum.Flag):
            try:
                return cls(value[4])
            except ValueError as e:
                raise _Refused(f"the root sent the flag value {value[4]} of {value[1]}."
                               f"{value[2]}, which this rank's enum does not take: {e}",
                               "schema_mismatch", f"{value[1]}.{value[2]}") from e
        raise _corrupt("a malformed enum member")

    def namedtuple_(self, value, depth):
        if not (len(value) == 4 and type(value[1]) is str and type(value[2]) is str
                and type(value[3]) is list):
            raise _corrupt("a malformed named tuple")
        cls = self.cls(value[1], value[2], "the named tuple", _is_namedtuple)
        if len(cls._fields) != len(value[3]):
            raise _Refused(f"the root sent {len(value[3])} fields of the named tuple {value[1]}."
                           f"{value[2]}, which has {len(cls._fields)} on this rank",
                           "schema_mismatch", f"{value[1]}.{value[2]}")
        fields = cls._fields
        return tuple.__new__(cls, self.elements(value[3], depth, lambda i: "." + fields[i]))

    def size_(self, value, depth):
        if len(value) != 2 or type(value[1]) is not list or any(type(d) is not int for d in value[1]):
            raise _corrupt("a malformed torch.Size")
        return torch.Size(value[1])

    def dict_kind_(self, value, depth):
        if value[0] == TAG_ORDERED_DICT:
            if len(value) != 2 or type(value[1]) is not dict:
                raise _corrupt("a malformed OrderedDict")
            return collections.OrderedDict(self.entries(value[1], depth))
        if len(value) != 3 or type(value[2]) is not dict:
            raise _corrupt("a malformed defaultdict")
        spec = value[1]
        if spec is None:
            factory = None
        elif type(spec) is str:
            factory = _FACTORIES.get(spec)
            if factory is None:
                raise _corrupt(f"a defaultdict factory {spec!r}")
        elif type(spec) is list and len(spec) == 2 and all(type(s) is str for s in spec):
            factory = self.cls(spec[0], spec[1], "a defaultdict whose default_factory is",
                               lambda c: True)
        else:
            raise _corrupt("a malformed defaultdict")
        return collections.defaultdict(factory, self.entries(value[2], depth))

    def numpy(self):
        # Imported only when the root sent a numpy value: numpy stays optional.
        try:
            import numpy
        except ImportError as e:
            raise _Refused("the root sent a numpy value and numpy is not installed on this rank; "
                           "install numpy on every rank", "schema_mismatch", "numpy") from e
        return numpy

    def dtype(self, np, text):
        dt = None
        if type(text) is str and _NUMPY_DTYPE.fullmatch(text):
            try:
                dt = np.dtype(text)
            except (TypeError, ValueError):  # "<i3", "<M8[abc]": the pattern, not a dtype
                pass
        # A zero-sized element ("|S0") is one byte an element in numpy: bytes nobody sent.
        if (dt is None or dt.kind not in _NUMPY_KINDS or dt.hasobject or dt.fields is not None
                or dt.subdtype is not None or dt.itemsize == 0):
            raise _corrupt(f"a numpy dtype {text!r}")
        return dt

    def ndarray_(self, value, depth):
        if not (len(value) == 4 and type(value[2]) is list and type(value[3]) is torch.Tensor
                and len(value[2]) <= 64 and all(type(d) is int and d >= 0 for d in value[2])):
            raise _corrupt("a malformed numpy array")
        np = self.numpy()
        dt = self.dtype(np, value[1])
        tensor, shape = value[3], value[2]
        key = (id(tensor), dt.str, tuple(shape))
        array = self.arrays.get(key)
        if array is not None:
            return array
        count = 1
        for d in shape:
            count *= d
        if (tensor.layout != torch.strided or tensor.dtype != torch.uint8 or tensor.dim() != 1 or not tensor.is_contiguous()
                or tensor.numel() != count * dt.itemsize):
            raise _corrupt("a numpy array whose bytes do not match its dtype and shape")
        if tensor.numel() == 0:
            # Empty: the other dimensions still multiply into numpy's size, which must fit.
            cells = dt.itemsize
            for d in shape:
                cells *= max(d, 1)
            if cells >= 1 << 62 or len(shape) > 64:
                raise _corrupt("an empty numpy array whose shape numpy cannot hold")
            array = np.zeros(shape, dt)
        else:
            # A view of the received bytes (which the array keeps alive), not a copy.
            array = tensor.numpy().view(dt).reshape(shape)
        self.arrays[key] = array  # the tree holds the tensor: its id stays its own
        return array

    def npscalar_(self, value, depth):
        if len(value) != 3 or type(value[2]) is not bytes:
            raise _corrupt("a malformed numpy scalar")
        np = self.numpy()
        dt = self.dtype(np, value[1])
        data = value[2]
        if len(data) != dt.itemsize or dt.itemsize == 0:
            raise _corrupt("a numpy scalar whose bytes do not match its dtype")
        # An element read from an array drops a str's or bytes' trailing NULs (and with them
        # the scalar's dtype size): build those from their bytes instead.
        if dt.kind == "S":
            return np.bytes_(data)
        if dt.kind == "U":
            try:
                return np.str_(data.decode("utf-32-be" if dt.str[0] == ">" else "utf-32-le"))
            except UnicodeDecodeError:
                raise _corrupt("a numpy str scalar that is not UTF-32") from None
        return np.frombuffer(data, dt)[0]


def open_envelope(envelope, rank, root_rank):
    """The body of a value envelope, still in wire form; the root's error raised as
    spbcast.RemoteError; anything else raises spbcast.SchemaError."""
    from .errors import RemoteError

    if not (type(envelope) is tuple and len(envelope) >= 3 and type(envelope[0]) is str
            and envelope[0] == MAGIC):
        raise SchemaError(f"spbcast: rank {rank}: the root did not send a value of the spbcast "
                          "Python package (is the root calling spbcast.broadcast from Python?)",
                          "schema_mismatch")
    version = envelope[1]
    if type(version) is not int or version != WIRE_VERSION:
        shown = version if type(version) is int else "(not a number)"
        raise SchemaError(f"spbcast: rank {rank}: the root's spbcast Python package writes wire "
                          f"version {shown}, this rank reads version {WIRE_VERSION}; install "
                          "the same spbcast on every rank", "version_mismatch",
                          str(WIRE_VERSION), str(shown))
    kind = envelope[2]
    if type(kind) is int and kind == KIND_ERROR and len(envelope) == 5 \
            and type(envelope[3]) is str and type(envelope[4]) is str:
        message = envelope[3]
        raise RemoteError(f"spbcast: rank {rank}: the root (rank {root_rank}) failed before "
                          f"sending: {message}", "remote", root_rank, message)
    if not (type(kind) is int and kind == KIND_VALUE and len(envelope) == 4):
        raise SchemaError(f"spbcast: rank {rank}: the root sent a malformed spbcast envelope, "
                          "which this version of the spbcast package cannot read (is the same "
                          "spbcast installed on every rank?)", "corrupt_frame")
    return envelope[3]


def decode_body(body, rank, name="batch"):
    """A body in wire form rebuilt; a value this rank will not rebuild raises
    spbcast.SchemaError naming its path, which starts with `name`."""
    try:
        return _Decoder(rank).decode(body)
    except _Refused as e:
        path = (None, name)
        for segment in reversed(e.segments):
            path = (path, segment)
        raise SchemaError(f"spbcast: rank {rank}: cannot rebuild {_path_text(path)}: {e.message}",
                          e.code, "", e.root_schema) from e.__cause__
    except RecursionError:  # a caller's own deep stack: the value itself is within MAX_DEPTH
        raise SchemaError(f"spbcast: rank {rank}: cannot rebuild {name}: its nesting exceeds this "
                          "thread's Python recursion limit (sys.setrecursionlimit)",
                          "limit_exceeded") from None


def decode(envelope, rank, root_rank, name="batch"):
    """The root's value from its envelope, or the root's error raised as spbcast.RemoteError;
    a value this rank will not rebuild raises spbcast.SchemaError naming its path."""
    return decode_body(open_envelope(envelope, rank, root_rank), rank, name)
