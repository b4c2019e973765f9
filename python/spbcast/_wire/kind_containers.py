"""The container kinds (as C++ detail/wire/kind_containers.hpp): lists (sequence), dicts with
str or int keys (map) and the core's other dicts - OrderedDict, defaultdict - sets and
frozensets, torch.Size. A list and a dict travel as themselves; the others as tagged tuples:

    (TAG_SET, [e...]) / (TAG_FROZENSET, [e...])  elements in a canonical order
    (TAG_SIZE, [d...])
    (TAG_ORDERED_DICT, {k: v})                   order kept
    (TAG_DEFAULTDICT, factory, {k: v})           factory: None, the name of a built-in type or
                                                   [module, qualname] of an allowed class
"""

import collections
import enum

import torch

from .field_path import Refused, corrupt
from .kind_records import is_namedtuple
from .kind_traits import (INT64_MAX, INT64_MIN, TAG_DEFAULTDICT, TAG_FROZENSET, TAG_ORDERED_DICT, TAG_SET,
                          TAG_SIZE, Kind)

# The default_factory values a defaultdict may have besides None and allowed classes: built-in
# types, rebuilt by this fixed table (a name on the wire, never an import).
_FACTORIES = {f.__name__: f for f in (list, dict, set, frozenset, tuple, int, float, str, bool,
                                      bytes, collections.OrderedDict)}


class Sequence(Kind):
    """A list, decoded in place."""

    types = decodes = (list,)
    levels = 1
    holds_values = True

    def encode(self, encoder, value, path, depth):
        return [encoder.encode(v, (path, i), depth) for i, v in enumerate(value)]

    def decode(self, decoder, value, depth):
        i = 0
        try:
            for i, v in enumerate(value):
                value[i] = decoder.decode(v, depth)
        except Refused as e:
            e.segments.append(i)
            raise
        return value


class Map(Kind):
    """A dict whose keys are all str or all int, decoded in place."""

    types = decodes = (dict,)
    levels = 1
    holds_values = True

    def encode(self, encoder, value, path, depth):
        return encode_entries(encoder, value, path, depth)

    def decode(self, decoder, value, depth):
        return decode_entries(decoder, value, depth)


def encode_entries(encoder, value, path, depth):
    """A dict (or a dict's subclass) as the core's dict: one key type, str or int."""
    out = {}
    kind = None
    for k, v in value.items():
        kt = type(k)
        if kt is not str and kt is not int:
            encoder.fail(path, f"a dict key of type {kt.__name__} ({k!r}); keys must be str or int")
        if kind is None:
            kind = kt
        elif kt is not kind:
            encoder.fail(path, "a dict that mixes str and int keys; use one key type per dict")
        if kt is int and not INT64_MIN <= k <= INT64_MAX:
            encoder.fail(path, f"the dict key {k} does not fit in 64 bits")
        if kt is str and not k.isascii() and not _is_utf8(k):
            encoder.fail(path, f"the dict key {k!r}, a str that is not valid UTF-8 (lone "
                               "surrogates); spbcast sends such strs as values, not as keys: "
                               "send the key os.fsencode()d or as bytes")
        out[k] = encoder.encode(v, (path, (k,)), depth)
    return out


def decode_entries(decoder, value, depth):
    """A dict's values decoded in place, at `depth`."""
    k = None
    try:
        for k, v in value.items():
            value[k] = decoder.decode(v, depth)
    except Refused as e:
        e.segments.append((k,))
        raise
    return value


def _is_utf8(text):
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


class OrderedDict(Kind):
    types = (collections.OrderedDict,)
    decodes = (TAG_ORDERED_DICT,)
    holds_values = True

    def encode(self, encoder, value, path, depth):
        return (TAG_ORDERED_DICT, encode_entries(encoder, value, path, depth))

    def decode(self, decoder, value, depth):
        if len(value) != 2 or type(value[1]) is not dict:
            raise corrupt("a malformed OrderedDict")
        return collections.OrderedDict(decode_entries(decoder, value[1], depth))


class DefaultDict(Kind):
    types = (collections.defaultdict,)
    decodes = (TAG_DEFAULTDICT,)
    holds_values = True

    def encode(self, encoder, value, path, depth):
        factory = value.default_factory
        if factory is None:
            spec = None
        elif _FACTORIES.get(getattr(factory, "__name__", None)) is factory:
            spec = factory.__name__
        elif isinstance(factory, type) and encoder.class_allowed(factory):
            spec = [factory.__module__, factory.__qualname__]
        else:
            encoder.fail(path, f"a defaultdict whose default_factory is {factory!r}; spbcast "
                               "rebuilds a defaultdict only with no factory, a built-in type ("
                               f"{', '.join(_FACTORIES)}) or an allowed class (spbcast.allow_classes); "
                               "send dict(d), or use one of those factories")
        return (TAG_DEFAULTDICT, spec, encode_entries(encoder, value, path, depth))

    def decode(self, decoder, value, depth):
        if len(value) != 3 or type(value[2]) is not dict:
            raise corrupt("a malformed defaultdict")
        spec = value[1]
        if spec is None:
            factory = None
        elif type(spec) is str:
            factory = _FACTORIES.get(spec)
            if factory is None:
                raise corrupt(f"a defaultdict factory {spec!r}")
        elif type(spec) is list and len(spec) == 2 and all(type(s) is str for s in spec):
            factory = decoder.allowed_class(spec[0], spec[1], "a defaultdict whose default_factory is",
                                            lambda c: True)
        else:
            raise corrupt("a malformed defaultdict")
        return collections.defaultdict(factory, decode_entries(decoder, value[2], depth))


class Set(Kind):
    """A set or frozenset, its elements in the order of set_key: the same in every process."""

    types = (set, frozenset)
    decodes = (TAG_SET, TAG_FROZENSET)

    def encode(self, encoder, value, path, depth):
        keyed = []
        for v in value:
            key = set_key(v)
            if key is None:
                encoder.fail(path, f"a {type(value).__name__} holding a {type(v).__name__} ({v!r:.60}); "
                                   "spbcast sends sets of None, bool, int, float, str, bytes, enum "
                                   "members and tuples or frozensets of them")
            keyed.append((key, v))
        keyed.sort(key=lambda kv: kv[0])
        tag = TAG_SET if type(value) is set else TAG_FROZENSET
        return (tag, [encoder.encode(v, (path, f"{{{i}}}"), depth) for i, (_, v) in enumerate(keyed)])

    def decode(self, decoder, value, depth):
        if len(value) != 2 or type(value[1]) is not list:
            raise corrupt("a malformed set")
        elements = decoder.elements(value[1], depth, lambda i: f"{{{i}}}")
        try:
            return set(elements) if value[0] == TAG_SET else frozenset(elements)
        except TypeError:  # an unhashable element: no root of this version sends one
            raise corrupt("a set holding an unhashable value") from None


def set_key(v):
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
    if isinstance(v, tuple) and (t is tuple or is_namedtuple(t)):
        keys = tuple(set_key(x) for x in v)
        return None if None in keys else (6, "" if t is tuple else t.__qualname__, keys)
    if t is frozenset:
        keys = [set_key(x) for x in v]
        return None if None in keys else (7, tuple(sorted(keys)))
    return None


class Size(Kind):
    types = (torch.Size,)
    decodes = (TAG_SIZE,)

    def encode(self, encoder, value, path, depth):
        return (TAG_SIZE, [int(d) for d in value])

    def decode(self, decoder, value, depth):
        if len(value) != 2 or type(value[1]) is not list or any(type(d) is not int for d in value[1]):
            raise corrupt("a malformed torch.Size")
        return torch.Size(value[1])
