"""The record kinds (as C++ detail/wire/kind_records.hpp): tuples, named tuples and objects -
dataclasses and plain classes - of allowed classes.

    (TAG_TUPLE, e0, e1, ...)                     a tuple (a user's tuple is tagged too, so no
                                                   user value can be mistaken for a tag)
    (TAG_NAMEDTUPLE, module, qualname, [v...])   rebuilt with tuple.__new__
    (TAG_OBJECT, module, qualname, {name: v})    rebuilt without calling __init__:
                                                   object.__new__ and the attributes set
"""

import dataclasses

from .field_path import Refused, corrupt
from .kind_traits import TAG_NAMEDTUPLE, TAG_OBJECT, TAG_TUPLE, Kind


def is_namedtuple(cls):
    return issubclass(cls, tuple) and type(getattr(cls, "_fields", None)) is tuple


class Tuple(Kind):
    types = (tuple,)
    decodes = (TAG_TUPLE,)
    levels = 1
    holds_values = True

    def encode(self, encoder, value, path, depth):
        return (TAG_TUPLE,) + tuple(encoder.encode(v, (path, i), depth) for i, v in enumerate(value))

    def decode(self, decoder, value, depth):
        return tuple(decoder.elements(value[1:], depth))


class NamedTuple(Kind):
    decodes = (TAG_NAMEDTUPLE,)
    holds_values = True

    def claims(self, cls, value):
        return is_namedtuple(cls)

    def check(self, encoder, cls, value, path):
        if "<locals>" in cls.__qualname__:
            encoder.fail(path, f"a {cls.__module__}.{cls.__qualname__}, a named tuple defined inside "
                               "a function; define it at module level so that every rank can find it")
        encoder.check_allowed(cls, path, "the named tuple")
        return self

    def encode(self, encoder, value, path, depth):
        cls = type(value)
        module, qualname = cls.__module__, cls.__qualname__
        if getattr(value, "__dict__", None):
            encoder.fail(path, f"a {module}.{qualname} with attributes besides its fields "
                               f"({sorted(vars(value))}); spbcast sends a named tuple's fields only")
        return (TAG_NAMEDTUPLE, module, qualname,
                [encoder.encode(v, (path, "." + f), depth) for f, v in zip(cls._fields, value)])

    def decode(self, decoder, value, depth):
        if not (len(value) == 4 and type(value[1]) is str and type(value[2]) is str
                and type(value[3]) is list):
            raise corrupt("a malformed named tuple")
        cls = decoder.allowed_class(value[1], value[2], "the named tuple", is_namedtuple)
        if len(cls._fields) != len(value[3]):
            raise Refused(f"the root sent {len(value[3])} fields of the named tuple {value[1]}."
                          f"{value[2]}, which has {len(cls._fields)} on this rank",
                          "schema_mismatch", f"{value[1]}.{value[2]}")
        fields = cls._fields
        return tuple.__new__(cls, decoder.elements(value[3], depth, lambda i: "." + fields[i]))


class Object(Kind):
    """A dataclass or a plain class's instance: its fields and its __dict__. Claims every class
    no kind before it in kinds.CLASS_KINDS took, and refuses those it cannot rebuild."""

    decodes = (TAG_OBJECT,)
    holds_values = True

    def claims(self, cls, value):
        return True

    def check(self, encoder, cls, value, path):
        what = f"{cls.__module__}.{cls.__qualname__}"
        if issubclass(cls, (list, tuple, dict, set, frozenset, str, bytes, int, float)):
            encoder.fail(path, f"an instance of {what}, a subclass of a built-in type; convert it to "
                               "the plain type (list, tuple, dict, set, str, bytes, int, float)")
        if cls.__new__ is not object.__new__:
            encoder.fail(path, f"an instance of {what}, whose class defines __new__ (or derives from "
                               "a built-in type); spbcast rebuilds objects with object.__new__ and "
                               "sends dataclasses and plain classes only")
        if not dataclasses.is_dataclass(value):
            if not hasattr(value, "__dict__"):
                encoder.fail(path, f"an instance of {what}, which has no __dict__ and is no dataclass")
            for klass in cls.__mro__:
                slots = klass.__dict__.get("__slots__", ())
                slots = (slots,) if isinstance(slots, str) else slots
                if any(s not in ("__dict__", "__weakref__") for s in slots):
                    encoder.fail(path, f"an instance of {what}, whose class has __slots__; make it a "
                                       "dataclass or a plain class")
        if "<locals>" in cls.__qualname__:
            encoder.fail(path, f"an instance of {what}, a class defined inside a function; define it "
                               "at module level so that every rank can import it")
        encoder.check_allowed(cls, path, "an instance of")
        return self

    def encode(self, encoder, value, path, depth):
        cls = type(value)
        state = {}
        if dataclasses.is_dataclass(value):
            for f in dataclasses.fields(value):
                state[f.name] = getattr(value, f.name)
        if hasattr(value, "__dict__"):
            state.update(vars(value))
        fields = {}
        for k, v in state.items():
            if type(k) is not str:
                encoder.fail(path, f"an attribute name {k!r} that is not a str")
            fields[k] = encoder.encode(v, (path, "." + k), depth)
        return (TAG_OBJECT, cls.__module__, cls.__qualname__, fields)

    def decode(self, decoder, value, depth):
        if not (len(value) == 4 and type(value[1]) is str and type(value[2]) is str
                and _is_str_dict(value[3])):
            raise corrupt("a malformed object")
        cls = decoder.allowed_class(value[1], value[2], "an instance of",
                                    lambda c: c.__new__ is object.__new__ and not is_namedtuple(c))
        obj = object.__new__(cls)
        values = {}
        k = None
        try:
            for k, v in value[3].items():
                values[k] = decoder.decode(v, depth)
        except Refused as e:
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
                    raise Refused(f"the root sent an attribute {k!r} of {value[1]}.{value[2]}, "
                                  "which is not one of its fields on this rank",
                                  "schema_mismatch", f"{value[1]}.{value[2]}")
                object.__setattr__(obj, k, v)
        return obj


def _is_str_dict(v):
    return type(v) is dict and all(type(k) is str for k in v)
