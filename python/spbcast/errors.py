"""Exceptions of spbcast, mirroring the C++ library's (include/spbcast/error.hpp).

Every exception carries ``code``, the C++ ``spbcast::errc`` name of the reason:
``unsupported_value``, ``limit_exceeded``, ``corrupt_frame``, ``version_mismatch``,
``schema_mismatch``, ``payload_corrupt``, ``remote``, ``transport``, ``timeout``,
``invalid_argument``, ``loader`` or ``out_of_step``.
"""


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
