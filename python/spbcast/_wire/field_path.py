"""Where a value sits in the batch, for the errors that name it (as C++ detail/wire/field_path.hpp),
and what a follower raises for a value it will not rebuild."""

import importlib
import json


def path_text(path):
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


class Refused(Exception):
    """A value this rank will not or cannot rebuild. Each container it passes through on the
    way out adds its segment, so the path costs nothing unless something is refused."""

    def __init__(self, message, code="schema_mismatch", root_schema=""):
        super().__init__(message)
        self.message, self.code, self.root_schema = message, code, root_schema
        self.segments = []  # innermost first


def corrupt(what):
    return Refused(f"the root sent {what}, which this version of the spbcast package cannot "
                   "read (is the same spbcast installed on every rank?)", "corrupt_frame")


def import_optional(module):
    """The module of an optional dependency, imported only when a root sent one of its values; a
    follower without it refuses that value, naming it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise Refused(f"the root sent a {module} value and {module} is not installed on this rank; "
                      f"install {module} on every rank", "schema_mismatch", module) from e
