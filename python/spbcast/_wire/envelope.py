"""The envelope around every broadcast value, so that followers know what the root sent: a value
or the root's error, in which version of this layer (as C++ detail/wire/frame.hpp's header)."""

from ..errors import RemoteError, SchemaError
from .field_path import Refused, path_text
from .value_codec import Decoder, Encoder

# Version 2 added the tags from TAG_SET on and the allow-list; 3 the tagged form of a str that
# is not UTF-8 (TAG_SURROGATE_STR); 4 jagged nested tensors and the tensordict kinds.
MAGIC = "spbcast.py"
WIRE_VERSION = 4
KIND_VALUE = 0
KIND_ERROR = 1


def encode(value, rank, name="batch"):
    """The root's value as an envelope for the core; raises spbcast.Error naming the path,
    which starts with `name`."""
    body = Encoder(rank).encode(value, (None, name))
    return (MAGIC, WIRE_VERSION, KIND_VALUE, body)


def error_envelope(error):
    return (MAGIC, WIRE_VERSION, KIND_ERROR, str(error), error.code)


def open_envelope(envelope, rank, root_rank):
    """The body of a value envelope, still in wire form; the root's error raised as
    spbcast.RemoteError; anything else raises spbcast.SchemaError."""
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
        return Decoder(rank).decode(body)
    except Refused as e:
        path = (None, name)
        for segment in reversed(e.segments):
            path = (path, segment)
        raise SchemaError(f"spbcast: rank {rank}: cannot rebuild {path_text(path)}: {e.message}",
                          e.code, "", e.root_schema) from e.__cause__
    except RecursionError:  # a caller's own deep stack: the value itself is within MAX_DEPTH
        raise SchemaError(f"spbcast: rank {rank}: cannot rebuild {name}: its nesting exceeds this "
                          "thread's Python recursion limit (sys.setrecursionlimit)",
                          "limit_exceeded") from None


def decode(envelope, rank, root_rank, name="batch"):
    """The root's value from its envelope, or the root's error raised as spbcast.RemoteError;
    a value this rank will not rebuild raises spbcast.SchemaError naming its path."""
    return decode_body(open_envelope(envelope, rank, root_rank), rank, name)
