"""The allow-list: the classes a follower rebuilds, which the program names on every rank with
allow_classes() / allow_modules(). It is consulted before any import, so a root cannot make a
follower import a module or build an object of a class nobody allowed."""

import importlib
import re
import sys
import types

from ..errors import Error

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

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


def allow_hint(module, qualname):
    return (f"call spbcast.allow_classes({module}.{qualname}) (or spbcast.allow_modules("
            f"{module.split('.')[0]!r})) on every rank, e.g. where the class is defined")


class NotAllowed(Exception):
    """A class name the program did not allow; the message (if any) says what to do."""


def allowed_class(module, qualname):
    """The class allowed under this name. Raises NotAllowed (before any import) when neither
    allow_classes nor allow_modules allowed it or the name is refused, any other exception when
    an allowed module cannot give it."""
    cls = _allowed_classes.get((module, qualname))
    if cls is not None:
        return cls
    rule = _module_rule(module)
    if rule is None:
        raise NotAllowed()
    problem = _module_name_problem(module)
    if problem is not None:
        raise NotAllowed(f"a module name with {problem}, which spbcast never looks up; a class "
                          "travels under its module's canonical dotted name")
    parts = qualname.split(".")
    if not all(_NAME.fullmatch(p) and not p.startswith("__") for p in parts):
        raise NotAllowed(f"{qualname!r} is not the qualified name of a class")
    mod = sys.modules.get(module)
    if mod is None:
        if not rule:
            raise NotAllowed(
                f"its module {module} is not imported on this rank, and spbcast imports nothing "
                f"a root names unless told to; import {module} on every rank (where the datasets "
                f"are built), or let followers import it: spbcast.allow_modules("
                f"{module.split('.')[0]!r}, allow_import=True)")
        mod = importlib.import_module(module)
    if getattr(mod, "__name__", None) != module:
        raise NotAllowed(f"{module} resolves to another module ({getattr(mod, '__name__', mod)!r}) "
                          "on this rank; a class travels under its module's canonical name")
    obj = mod
    for part in parts:
        obj = getattr(obj, part)
    if not isinstance(obj, type) or obj.__module__ != module or obj.__qualname__ != qualname:
        raise LookupError(f"{module}.{qualname} is not a class defined in {module} (it names "
                          f"{obj!r})")
    return obj
