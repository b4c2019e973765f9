"""The scalar kinds (as C++ detail/wire/kind_scalars.hpp): None, bool, float, int, str, bytes,
tensors and enum members. All but enum members are carried by the core as they are; a follower
gets them back as such (the C++ side turns the tagged forms of bytes and of a str that is not
UTF-8 back into bytes and str), so only the root checks them against the core's bounds."""

import enum

import torch

from .. import _C
from .field_path import Refused, corrupt
from .kind_traits import INT64_MAX, INT64_MIN, MAX_STRING_BYTES, TAG_BYTES, TAG_ENUM, Kind, check_bytes


class AsIs(Kind):
    """None, bool and float: the core's own values, nothing to check."""

    types = (type(None), bool, float)
    levels = 0
    as_is = True


class Integer(Kind):
    types = (int,)
    levels = 0

    def encode(self, encoder, value, path, depth):
        if not INT64_MIN <= value <= INT64_MAX:
            encoder.fail(path, f"the int {value} does not fit in 64 bits; send it as a str")
        return value


class String(Kind):
    """A str; one that is not valid UTF-8 (lone surrogates, as os.fsdecode gives a name that is
    not UTF-8) travels as (TAG_SURROGATE_STR, its "surrogatepass" bytes), made and read by the
    C++ side."""

    types = (str,)
    levels = 0

    def encode(self, encoder, value, path, depth):
        if len(value) > MAX_STRING_BYTES // 4 and utf8_size(value) > MAX_STRING_BYTES:
            encoder.fail(path, f"a str of {utf8_size(value)} bytes, over spbcast's limit of "
                               f"{MAX_STRING_BYTES} per string; send large data as a uint8 tensor")
        return value


def utf8_size(text):
    # Lone surrogates travel as the 3 bytes "surrogatepass" gives them.
    return len(text.encode("utf-8", "surrogatepass"))


class Bytes(Kind):
    """(TAG_BYTES, b"..."): the C++ side turns it into bytes, and back into bytes."""

    types = (bytes,)
    levels = 0

    def encode(self, encoder, value, path, depth):
        check_bytes(encoder, value, path)
        return (TAG_BYTES, value)


class Tensor(Kind):
    """A dense strided CPU tensor of a dtype the core sends (a subclass: kinds.Unsupported)."""

    types = (torch.Tensor,)
    levels = 0

    def encode(self, encoder, value, path, depth):
        if value.device.type != "cpu":
            encoder.fail(path, f"a tensor on {value.device}; spbcast sends CPU tensors, so move it "
                               "to the CPU in the collator (.cpu())")
        if value.is_nested:
            encoder.fail(path, "a nested tensor of the strided layout; spbcast sends nested tensors "
                               "of the jagged layout: build it with layout=torch.jagged (torch.nested."
                               "nested_tensor(ts, layout=torch.jagged), or torch.nested.as_nested_tensor"
                               "(t.unbind(), layout=torch.jagged)), or send t.unbind() or "
                               "t.to_padded_tensor(0)")
        if value.layout != torch.strided:
            encoder.fail(path, f"a {str(value.layout).replace('torch.', '')} tensor; spbcast sends "
                               "dense strided tensors (convert it, e.g. t.to_dense())")
        if not _C.dtype_supported(value):
            encoder.fail(path, f"a tensor of dtype {value.dtype}, which spbcast does not send")
        return value


class Enumeration(Kind):
    """An enum member of an allowed class: (TAG_ENUM, module, qualname, name), rebuilt by
    lookup; a composite Flag as (TAG_ENUM, module, qualname, None, value)."""

    decodes = (TAG_ENUM,)

    def claims(self, cls, value):
        return isinstance(value, enum.Enum)

    def check(self, encoder, cls, value, path):
        encoder.check_allowed(cls, path, "the enum")
        return self

    def encode(self, encoder, value, path, depth):
        cls = type(value)
        module, qualname = cls.__module__, cls.__qualname__
        if value.name is not None and cls.__members__.get(value.name) is value:
            return (TAG_ENUM, module, qualname, value.name)
        if isinstance(value, enum.Flag) and type(value.value) is int \
                and INT64_MIN <= value.value <= INT64_MAX:
            return (TAG_ENUM, module, qualname, None, value.value)  # a composite flag
        encoder.fail(path, f"the enum member {value!r}, which is neither a named member nor an int "
                           "Flag; send its .value")

    def decode(self, decoder, value, depth):
        if not (len(value) in (4, 5) and type(value[1]) is str and type(value[2]) is str):
            raise corrupt("a malformed enum member")
        cls = decoder.allowed_class(value[1], value[2], "a member of the enum",
                                    lambda c: issubclass(c, enum.Enum))
        if len(value) == 4 and type(value[3]) is str:
            member = cls.__members__.get(value[3])
            if member is None:
                raise Refused(f"the root sent the member {value[3]!r} of {value[1]}.{value[2]}, "
                              "which this rank's enum does not have", "schema_mismatch",
                              f"{value[1]}.{value[2]}")
            return member
        if len(value) == 5 and value[3] is None and type(value[4]) is int and issubclass(cls, enum.Flag):
            try:
                return cls(value[4])
            except ValueError as e:
                raise Refused(f"the root sent the flag value {value[4]} of {value[1]}."
                              f"{value[2]}, which this rank's enum does not take: {e}",
                              "schema_mismatch", f"{value[1]}.{value[2]}") from e
        raise corrupt("a malformed enum member")
