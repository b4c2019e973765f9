"""The jagged nested tensor kind (no C++ counterpart: the core sees its parts, plain tensors).

    (TAG_JAGGED, values, offsets, lengths | None, ragged_idx, min_seqlen | None,
     max_seqlen | None, requires_grad)

values, offsets and lengths travel as the batch's other tensors do (de-duplicated, aliased,
in place, over the same-host path): a values tensor that the batch also holds, or that two
nested tensors share, arrives as one. A follower checks the parts before torch sees them -
torch.nested.nested_tensor_from_jagged checks nothing, and an offset beyond the values would
read outside them later - and builds the tensor with the same ragged dimension, the same
cached min/max sequence lengths (absent where the root had none) and requires_grad. Two
nested tensors that share their offsets share them on a follower too, and with them the
ragged size (torch's nested int), so they still combine.

Nested tensors of the strided layout (torch.nested's default) are refused by the Tensor kind,
with what to send instead. The torch internals read here are named in torch_nested.
"""

import torch

from . import torch_nested
from .field_path import Refused, corrupt
from .kind_traits import INT64_MAX, TAG_JAGGED, Kind

_INDEX_DTYPES = (torch.int64, torch.int32)


class JaggedNested(Kind):
    decodes = (TAG_JAGGED,)
    levels = 1

    def claims(self, cls, value):
        return torch_nested.is_jagged(value)

    def check(self, encoder, cls, value, path):
        if cls is not torch_nested.jagged_class():
            encoder.fail(path, f"a jagged nested tensor of the subclass {cls.__module__}."
                               f"{cls.__qualname__}; send a plain one (torch.nested."
                               "nested_tensor_from_jagged(t.values(), t.offsets(), t.lengths()))")
        return self

    def encode(self, encoder, value, path, depth):
        if value.device.type != "cpu":
            encoder.fail(path, f"a nested tensor on {value.device}; spbcast sends CPU tensors, so "
                               "move it to the CPU in the collator (.cpu())")
        try:
            p = torch_nested.parts(value)
        except TypeError as e:
            encoder.fail(path, f"a jagged nested tensor spbcast cannot read on this torch: {e}")
        wrong = problem(p.values, p.offsets, p.lengths, p.ragged_idx, p.min_seqlen, p.max_seqlen)
        if wrong is not None:  # the followers would refuse it: one clear error, from the root
            encoder.fail(path, f"a jagged nested tensor {wrong}; build it with offsets (and "
                               "lengths) that describe its values")
        lengths = None if p.lengths is None else encoder.encode(p.lengths, (path, ".lengths()"), depth)
        return (TAG_JAGGED, encoder.encode(p.values, (path, ".values()"), depth),
                encoder.encode(p.offsets, (path, ".offsets()"), depth), lengths, int(p.ragged_idx),
                p.min_seqlen, p.max_seqlen, bool(value.requires_grad))

    def decode(self, decoder, value, depth):
        if not (len(value) == 8 and all(type(value[i]) is torch.Tensor for i in (1, 2))
                and (value[3] is None or type(value[3]) is torch.Tensor) and type(value[4]) is int
                and all(value[i] is None or type(value[i]) is int for i in (5, 6))
                and type(value[7]) is bool):
            raise corrupt("a malformed jagged nested tensor")
        _, values, offsets, lengths, ragged_idx, min_seqlen, max_seqlen, requires_grad = value
        if torch_nested.jagged_class() is None:
            raise Refused("the root sent a jagged nested tensor, which this rank's torch does not "
                          "have; install the same torch on every rank", "schema_mismatch", "torch")
        wrong = problem(values, offsets, lengths, ragged_idx, min_seqlen, max_seqlen)
        if wrong is not None:
            raise corrupt(f"a jagged nested tensor {wrong}")
        try:
            nt = torch_nested.build(values, offsets, lengths, ragged_idx, min_seqlen, max_seqlen)
            if requires_grad and not nt.requires_grad:
                nt.requires_grad_(True)
        except (RuntimeError, ValueError, TypeError) as e:
            raise corrupt(f"a jagged nested tensor that torch does not build ({e})") from None
        if nt.requires_grad != requires_grad:
            raise corrupt("a jagged nested tensor whose requires_grad differs from its values'")
        return nt


def problem(values, offsets, lengths, ragged_idx, min_seqlen, max_seqlen):
    """What is wrong with these parts of a jagged nested tensor (which torch would take without
    a check, and misread later), or None."""
    if values.dim() < 1 or not 1 <= ragged_idx <= values.dim():
        return (f"whose ragged dimension {ragged_idx} is not one of its values' {values.dim()} "
                "dimensions")
    for name, t in (("offsets", offsets), ("lengths", lengths)):
        if t is not None and (t.dtype not in _INDEX_DTYPES or t.dim() != 1):
            return f"whose {name} are not a 1-d int64 or int32 tensor ({t.dtype}, {t.dim()}-d)"
    if offsets.numel() < 1:
        return "with no offsets (a batch of B has B + 1)"
    if lengths is not None and lengths.numel() != offsets.numel() - 1:
        return (f"with {lengths.numel()} lengths and {offsets.numel()} offsets (a batch of B has "
                "B lengths, B + 1 offsets)")
    total = values.shape[ragged_idx - 1]
    o = offsets.to(torch.int64)
    if bool((o[1:] < o[:-1]).any()) or int(o[0]) < 0 or int(o[-1]) > total:
        return f"whose offsets are not non-decreasing within its {total} values along the ragged dimension"
    if lengths is None and (int(o[0]) != 0 or int(o[-1]) != total):
        # torch reads such a tensor's components as the splits of all its values.
        return (f"whose offsets run from {int(o[0])} to {int(o[-1])}, not over its {total} values "
                "along the ragged dimension (with no lengths, they cover the values exactly)")
    if lengths is not None:
        n = lengths.to(torch.int64)
        if bool((n < 0).any()) or bool((n > total - o[:-1]).any()):
            return f"whose lengths reach beyond its {total} values along the ragged dimension"
    for name, s in (("min_seqlen", min_seqlen), ("max_seqlen", max_seqlen)):
        if s is not None and not 0 <= s <= INT64_MAX:
            return f"with a cached {name} of {s}"
    return None
