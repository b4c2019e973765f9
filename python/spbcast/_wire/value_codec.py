"""The walk over a value tree (as C++ detail/wire/value_codec.hpp): the root's Encoder and a
follower's Decoder recurse through the kind table (kinds.py), and keep what belongs to the
whole walk - the nesting bound, the containers on the current path (cycles), the path an error
names, the classes resolved once per broadcast - so that each kind states only its own value."""

from ..errors import Error
from .allow_list import NotAllowed, allow_hint, allowed_class
from .field_path import Refused, corrupt, path_text
from .kind_traits import MAX_DEPTH
from .kinds import AS_IS, BY_TYPE, BY_WIRE, CLASS_KINDS, LEAVES


class Encoder:
    def __init__(self, rank):
        self.rank = rank
        self.active = set()  # ids of the containers on the current path (cycle detection)
        self.class_kinds = {}  # class -> its kind, checked once per class
        self.arrays = {}  # id(numpy array) -> (array, tensor): an array sent twice is one tensor

    def fail(self, path, what):
        raise Error(f"spbcast: rank {self.rank}: cannot send {path_text(path)}: {what}",
                    "unsupported_value")

    def encode(self, value, path, depth=0):
        t = type(value)
        if t in AS_IS:
            return value
        leaf = LEAVES.get(t)
        if leaf is not None:
            return leaf(self, value, path, depth)
        if depth >= MAX_DEPTH:
            self.fail(path, f"containers nested deeper than {MAX_DEPTH} levels")
        kind = BY_TYPE.get(t)
        if kind is None:
            kind = self.class_kinds.get(t)
            if kind is None:
                kind = self.class_kinds[t] = self.class_kind(t, value, path)
        if not kind.holds_values:
            return kind.encode(self, value, path, depth + kind.levels)
        # The containers and objects on the current path: meeting one again is a cycle.
        key = id(value)
        if key in self.active:
            self.fail(path, "a reference cycle; spbcast sends trees of values")
        self.active.add(key)
        try:
            return kind.encode(self, value, path, depth + kind.levels)
        finally:
            self.active.discard(key)

    def class_kind(self, cls, value, path):
        """The kind of a class no type lookup found, checked as that kind requires."""
        for kind in CLASS_KINDS:
            if kind.claims(cls, value):
                return kind.check(self, cls, value, path)
        raise AssertionError("kinds.CLASS_KINDS ends with a kind that claims every class")

    def class_allowed(self, cls):
        try:
            return allowed_class(cls.__module__, cls.__qualname__) is cls
        except Exception:  # noqa: BLE001 - not allowed, or not found again: either way, no
            return False

    def check_allowed(self, cls, path, what):
        # Checked on the root too, so that a class the program forgot to allow is one clear
        # error on every rank (the followers check again for themselves).
        module, qualname = cls.__module__, cls.__qualname__
        try:
            found = allowed_class(module, qualname)
        except NotAllowed as e:
            self.fail(path, f"{what} {module}.{qualname}, " + (str(e) or (
                "a class spbcast rebuilds only when the program allows it; "
                + allow_hint(module, qualname))))
        except Exception as e:  # noqa: BLE001 - any failure means: not found again
            found = e
        if found is not cls:
            self.fail(path, f"{what} {module}.{qualname}, which cannot be found again by its "
                            "module and name (a class allowed under that name is another class "
                            "object, e.g. one a decorator replaced, or the module does not "
                            "define it); allow the final class, defined at module level")


class Decoder:
    def __init__(self, rank):
        self.rank = rank
        self.classes = {}  # (module, qualname, kind) -> class, resolved once per broadcast
        self.arrays = {}  # (id(tensor), dtype, shape) -> numpy array: an array sent once is one

    def decode(self, value, depth=0):
        # One Python frame per level of nesting, and the encoder's count of levels (MAX_DEPTH,
        # an object or other tagged kind counting twice), so whatever the core passes either
        # decodes or is refused here - never a RecursionError.
        t = type(value)
        if t is not list and t is not dict and t is not tuple:
            return value
        if depth >= MAX_DEPTH:
            raise corrupt(f"containers nested deeper than {MAX_DEPTH} levels")
        if t is tuple:
            tag = value[0] if value and type(value[0]) is int else None
            kind = BY_WIRE.get(tag)
            if kind is None:
                raise corrupt(f"a tuple with the tag {tag!r}")
        else:
            kind = BY_WIRE[t]
        return kind.decode(self, value, depth + kind.levels)

    def elements(self, values, depth, segment=lambda i: i):
        out = []
        try:
            for v in values:
                out.append(self.decode(v, depth))
        except Refused as e:
            e.segments.append(segment(len(out)))
            raise
        return out

    def allowed_class(self, module, qualname, what, check):
        """The allowed class the root named, checked to be of the kind `check` accepts; refused
        before any import when the program did not allow it."""
        key = (module, qualname, what)  # per kind: an enum allowed as such is no plain class
        cls = self.classes.get(key)
        if cls is not None:
            return cls
        name = f"{module}.{qualname}"
        try:
            cls = allowed_class(module, qualname)
        except NotAllowed as e:
            why = str(e) or ("a class this rank rebuilds only when the program allows it; "
                             + allow_hint(module, qualname))
            raise Refused(f"the root sent {what} {name}, {why}", "schema_mismatch", name) from None
        except Exception as e:  # noqa: BLE001 - an allowed module that cannot give the class
            raise Refused(f"the root sent {what} {name}, which this rank cannot import: "
                          f"{type(e).__name__}: {e}", "schema_mismatch", name) from e
        if not check(cls):
            raise Refused(f"the root sent {what} {name}, which is not a class of that kind on "
                          "this rank (is the same program running on every rank?)",
                          "schema_mismatch", name)
        self.classes[key] = cls
        return cls
