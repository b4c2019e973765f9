"""Exceptions of spbcast, mirroring the C++ library's (include/spbcast/error.hpp).

Every exception carries ``code``, the C++ ``spbcast::errc`` name of the reason:
``unsupported_value``, ``limit_exceeded``, ``corrupt_frame``, ``version_mismatch``,
``schema_mismatch``, ``payload_corrupt``, ``remote``, ``transport``, ``timeout``,
``invalid_argument``, ``loader``, ``refused`` or ``out_of_step``.

``loader`` is the data loader's own exception (``LoaderError``); ``refused`` a batch the loader
produced that spbcast will not carry (a class the program did not allow, a value of no supported
kind): a trainer that skips bad samples on ``loader`` does not skip a program error with it.
"""

import builtins


class Error(RuntimeError):
    """Any failure spbcast reports; ``code`` says why in one word."""

    def __init__(self, message, code="invalid_argument"):
        super().__init__(message)
        self.code = code

    def __reduce__(self):
        return (type(self), self.args + (self.code,))


class RemoteError(Error):
    """Raised on every non-root rank when the root failed before its value could be sent.

    ``root_message`` is the root's own message, with the path of the offending value.
    """

    def __init__(self, message, code="remote", root_rank=-1, root_message=""):
        super().__init__(message, code)
        self.root_rank = root_rank
        self.root_message = root_message

    def __reduce__(self):
        return (type(self), (str(self), self.code, self.root_rank, self.root_message))


class SchemaError(Error):
    """The root and this rank disagree on what was sent (another spbcast wire version)."""

    def __init__(self, message, code="schema_mismatch", local_schema="", root_schema=""):
        super().__init__(message, code)
        self.local_schema = local_schema
        self.root_schema = root_schema

    def __reduce__(self):
        return (type(self), (str(self), self.code, self.local_schema, self.root_schema))


class TransportError(Error):
    """The process group failed or a wait timed out (``code`` is ``transport`` or ``timeout``).

    The group should be considered broken afterwards: a peer is dead or out of step.
    """

    def __init__(self, message, code="transport", phase=""):
        super().__init__(message, code)
        self.phase = phase

    def __reduce__(self):
        return (type(self), (str(self), self.code, self.phase))


class LoaderError(Error):
    """The data loader itself raised (on the SP leader: building it, a fetch, set_epoch,
    restoring its state); ``code`` is ``loader``.

    ``original_type`` names the loader's exception type (``"KeyError"``, ``"mypkg.BadSample"``)
    and ``original_message`` is its message. Where it can, the exception spbcast raises is also
    an instance of that type, so ``except KeyError`` means the same with dedup on and off: on the
    leader for any type (its ``__cause__`` is the loader's exception itself), on the followers for
    Python's built-in exception types (a follower imports no code a root names).
    """

    __str__ = BaseException.__str__  # the message as it is, not KeyError's repr of it

    def __init__(self, message, code="loader", original_type="", original_message=""):
        super().__init__(message, code)
        self.original_type = original_type
        self.original_message = original_message

    def __reduce__(self):
        return (_rebuild_loader_error, (str(self), self.code, self.original_type,
                                        self.original_message))


_AS_LOADER_ERROR = {}  # original class -> its LoaderError subclass (None: it cannot be one)


def type_name(cls):
    """The name a LoaderError gives a type: bare for Python's built-ins, module-qualified else."""
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _loader_error_class(original):
    """LoaderError's subclass that is also ``original`` (cached), or LoaderError where the two
    cannot be combined: a base with another instance layout (OSError, ...), a class that forbids
    subclassing or whose __new__ needs arguments."""
    if original is None or not issubclass(original, Exception) or issubclass(original, LoaderError):
        return LoaderError
    if original not in _AS_LOADER_ERROR:
        try:
            combined = type(f"LoaderError[{type_name(original)}]", (LoaderError, original),
                            {"__module__": __name__})
            combined.__new__(combined)  # a layout conflict may show only here (OSError)
            _AS_LOADER_ERROR[original] = combined
        except TypeError:
            _AS_LOADER_ERROR[original] = None
    return _AS_LOADER_ERROR[original] or LoaderError


def builtin_exception(name):
    """Python's built-in exception class called ``name``, or None (never another module's)."""
    cls = getattr(builtins, name, None) if name.isidentifier() else None
    return cls if isinstance(cls, type) and issubclass(cls, Exception) else None


def loader_error(message, original_type, original_message, original_class=None):
    """The LoaderError to raise for a loader exception of ``original_type``: also an instance of
    ``original_class`` (the leader) or of the built-in type of that name (the followers)."""
    cls = _loader_error_class(original_class or builtin_exception(original_type))
    error = cls.__new__(cls)  # the original class's own __init__ (any signature) is not run
    LoaderError.__init__(error, message, "loader", original_type, original_message)
    return error


def _rebuild_loader_error(message, code, original_type, original_message):
    error = loader_error(message, original_type, original_message)
    error.code = code
    return error


class ResumeWarning(UserWarning):
    """LeaderLoader.load_state_dict resumes mid-epoch by dropping batches where it cannot show
    that this gives the continuous run's order (warned on every SP rank; silence it with
    ``warnings.simplefilter("ignore", spbcast.ResumeWarning)`` where the order is the epoch's
    alone)."""
