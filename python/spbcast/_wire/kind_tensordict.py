"""The tensordict kinds (no C++ counterpart: the core sees tuples, dicts and tensors).
tensordict stays optional: the root meets a TensorDict only where the program imported
tensordict, and a follower imports it only when the root sent one.

    (TAG_TENSORDICT, {key: entry}, [batch_size], device, names, locked)
    (TAG_NON_TENSOR_DATA, data, [batch_size], device)
    (TAG_NON_TENSOR_STACK, [item...], stack_dim, [batch_size])

device is None or "cpu" (spbcast sends CPU tensors); names is None where no dimension is named,
else one str or None per batch dimension. A TensorDict's entries keep their order and are
tensors (jagged nested tensors included), TensorDicts, NonTensorData and NonTensorStacks;
NonTensorData's data is any value the wire sends (its own kinds and allow-list: an object in
it is rebuilt only when its class is allowed); a NonTensorStack's items are NonTensorData
and NonTensorStacks.

These three classes, exactly, are built-in kinds like OrderedDict: spbcast rebuilds them with
their public constructors and needs no allow_classes for them. Any other class of tensordict
(LazyStackedTensorDict, a TensorDict subclass, a tensorclass - tensordict's or the program's)
is refused on the root with what to send instead. A follower checks what it rebuilds against
what the root sent (batch sizes, keys, names) and refuses a value tensordict would build
differently.
"""

import sys

import torch

from . import torch_nested
from .field_path import Refused, corrupt, import_optional
from .kind_containers import decode_entries, encode_entries
from .kind_traits import TAG_NON_TENSOR_DATA, TAG_NON_TENSOR_STACK, TAG_TENSORDICT, Kind

_MAX_DIMS = 64


def from_tensordict(cls):
    """Whether `cls` is one of tensordict's classes (TensorDict, NonTensorData, ...)."""
    return cls.__module__.split(".")[0] == "tensordict" and "tensordict" in sys.modules


def _is_tensorclass(cls):
    td = sys.modules.get("tensordict")
    is_tc = getattr(td, "is_tensorclass", None)
    return is_tc is not None and is_tc(cls)


def _device(encoder, value, path):
    device = value.device
    if device is None:
        return None
    if torch.device(device).type != "cpu":
        encoder.fail(path, f"a {type(value).__name__} on {device}; spbcast sends CPU tensors, so "
                           "move it to the CPU in the collator (.cpu())")
    return "cpu"


def _batch(value):
    if not (type(value) is list and len(value) <= _MAX_DIMS
            and all(type(d) is int and d >= 0 for d in value)):
        raise corrupt("a malformed tensordict batch_size")
    return value


def _check_device(value):
    if value is not None and value != "cpu":
        raise corrupt(f"a tensordict value on the device {value!r}")
    return value


def _rebuilt(build, what):
    try:
        return build()
    except (RuntimeError, ValueError, TypeError, KeyError, IndexError) as e:
        raise corrupt(f"a {what} that tensordict does not build ({type(e).__name__}: {e})") from None


class _TensorDictValue(Kind):
    """A value of one tensordict class, exactly (tensordict's attribute `name`)."""

    name = None
    holds_values = True

    def claims(self, cls, value):
        return from_tensordict(cls) and cls is getattr(sys.modules["tensordict"], self.name, None)


class TensorDict(_TensorDictValue):
    name = "TensorDict"
    decodes = (TAG_TENSORDICT,)

    def encode(self, encoder, value, path, depth):
        td = sys.modules["tensordict"]
        kinds = (td.TensorDict, td.NonTensorData, td.NonTensorStack)
        entries = {}
        for k, v in value.items():
            if not (isinstance(v, torch.Tensor) or type(v) in kinds):
                encoder.fail((path, (k,)), f"a TensorDict entry of the class {type(v).__module__}."
                                           f"{type(v).__qualname__}; spbcast sends TensorDicts of "
                                           "tensors, TensorDicts, NonTensorData and NonTensorStack "
                                           "(send another tensordict class's .to_tensordict())")
            entries[k] = v
        names = list(value.names) if value.batch_dims else []
        return (TAG_TENSORDICT, encode_entries(encoder, entries, path, depth),
                [int(d) for d in value.batch_size], _device(encoder, value, path),
                names if any(n is not None for n in names) else None, bool(value.is_locked))

    def decode(self, decoder, value, depth):
        if not (len(value) == 6 and type(value[1]) is dict and all(type(k) is str for k in value[1])
                and type(value[5]) is bool):
            raise corrupt("a malformed TensorDict")
        batch = _batch(value[2])
        device = _check_device(value[3])
        names = value[4]
        if names is not None and not (type(names) is list and len(names) == len(batch)
                                      and all(n is None or type(n) is str for n in names)):
            raise corrupt("a TensorDict whose names do not match its batch_size")
        td = import_optional("tensordict")
        entries = decode_entries(decoder, value[1], depth)
        kinds = (td.TensorDict, td.NonTensorData, td.NonTensorStack)
        for k, v in entries.items():
            if not (type(v) is torch.Tensor or type(v) in kinds or torch_nested.is_jagged(v)):
                raise corrupt(f"a TensorDict entry {k!r} of the class {type(v).__qualname__}")
            if not _leads_with(v, batch):
                raise corrupt(f"a TensorDict of batch_size {batch} whose entry {k!r} is of shape "
                              f"{list(_shape(v))}")
        out = _rebuilt(lambda: td.TensorDict(entries, batch_size=batch, device=device, names=names),
                       "TensorDict")
        if value[5]:
            out.lock_()
        if list(out.keys()) != list(entries) or list(out.batch_size) != batch:
            raise corrupt("a TensorDict that this rank's tensordict rebuilds differently")
        return out


class NonTensorData(_TensorDictValue):
    name = "NonTensorData"
    decodes = (TAG_NON_TENSOR_DATA,)
    levels = 1

    def encode(self, encoder, value, path, depth):
        return (TAG_NON_TENSOR_DATA, encoder.encode(value.data, (path, ".data"), depth),
                [int(d) for d in value.batch_size], _device(encoder, value, path))

    def decode(self, decoder, value, depth):
        if len(value) != 4:
            raise corrupt("a malformed NonTensorData")
        batch = _batch(value[2])
        device = _check_device(value[3])
        try:
            data = decoder.decode(value[1], depth)
        except Refused as e:
            e.segments.append(".data")
            raise
        td = import_optional("tensordict")
        out = _rebuilt(lambda: td.NonTensorData(data=data, batch_size=batch, device=device),
                       "NonTensorData")
        if type(out) is not td.NonTensorData or list(out.batch_size) != batch:
            raise corrupt("a NonTensorData that this rank's tensordict rebuilds differently")
        return out


class NonTensorStack(_TensorDictValue):
    name = "NonTensorStack"
    decodes = (TAG_NON_TENSOR_STACK,)

    def encode(self, encoder, value, path, depth):
        td = sys.modules["tensordict"]
        items = list(value.tensordicts)
        for i, item in enumerate(items):
            if type(item) not in (td.NonTensorData, td.NonTensorStack):
                encoder.fail((path, i), f"a NonTensorStack item of the class {type(item).__qualname__}"
                                        "; spbcast sends stacks of NonTensorData and NonTensorStack")
        return (TAG_NON_TENSOR_STACK,
                [encoder.encode(v, (path, f".tensordicts[{i}]"), depth) for i, v in enumerate(items)],
                int(value.stack_dim), [int(d) for d in value.batch_size])

    def decode(self, decoder, value, depth):
        if not (len(value) == 4 and type(value[1]) is list and type(value[2]) is int):
            raise corrupt("a malformed NonTensorStack")
        batch = _batch(value[3])
        if not 0 <= value[2] < max(len(batch), 1):
            raise corrupt(f"a NonTensorStack whose stack_dim {value[2]} is not one of its "
                          f"{len(batch)} dimensions")
        items = decoder.elements(value[1], depth, lambda i: f".tensordicts[{i}]")
        td = import_optional("tensordict")
        if not all(type(v) in (td.NonTensorData, td.NonTensorStack) for v in items):
            raise corrupt("a NonTensorStack holding something other than NonTensorData and "
                          "NonTensorStack")
        out = _rebuilt(lambda: td.NonTensorStack(*items, stack_dim=value[2]), "NonTensorStack")
        if type(out) is not td.NonTensorStack or list(out.batch_size) != batch:
            raise corrupt("a NonTensorStack that this rank's tensordict rebuilds differently")
        return out


class TensorDictOther(Kind):
    """Every other class of tensordict, and tensorclasses: refused, with what to send instead."""

    def claims(self, cls, value):
        return from_tensordict(cls) or _is_tensorclass(cls)

    def check(self, encoder, cls, value, path):
        what = f"{cls.__module__}.{cls.__qualname__}"
        if _is_tensorclass(cls):
            encoder.fail(path, f"an instance of the tensorclass {what}; spbcast sends TensorDict, "
                               "NonTensorData and NonTensorStack: send tc.to_tensordict()")
        encoder.fail(path, f"an instance of {what}; spbcast sends the tensordict classes "
                           "TensorDict, NonTensorData and NonTensorStack: send td.to_tensordict()")


def _shape(v):
    return v.batch_size if not isinstance(v, torch.Tensor) else v.shape


def _leads_with(v, batch):
    shape = _shape(v)
    if len(shape) < len(batch):
        return False
    # A ragged size (a jagged tensor's nested int) is no batch dimension: it equals no int.
    return all(type(d) is int and d == b for d, b in zip(shape, batch))
