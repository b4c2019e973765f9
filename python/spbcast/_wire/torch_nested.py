"""The torch internals the jagged nested tensor kind (kind_nested) reads and builds, named and
guarded here alone: they differ between torch releases, and nothing else in spbcast names them.

A jagged nested tensor (torch.nested, layout=torch.jagged) is a Python tensor subclass holding
plain tensors: its values (the components packed along one dimension), its offsets and,
for a non-contiguous one (torch.nested.narrow), its lengths. What torch gives no public
accessor for:

    _values          the values tensor itself (values() returns a new view each call, and one
                     that carries autograd): the root sends this tensor, so that a values
                     tensor the batch also holds, or two nested tensors share, stays one
    _ragged_idx      the ragged dimension (1 unless transposed)
    _metadata_cache  the cached min/max sequence lengths ("min_seqlen", "max_seqlen"), each
                     a tensor whose first size is the value (torch's _load_val_from_tensor),
                     absent until computed or given

A follower builds one with the public torch.nested.nested_tensor_from_jagged (values, offsets,
lengths, jagged_dim, min_seqlen, max_seqlen), torch >= 2.4's signature.
"""

import sys

import torch

_MODULE = "torch.nested._internal.nested_tensor"


def jagged_class():
    """torch's class of jagged nested tensors, or None where torch has none."""
    module = sys.modules.get(_MODULE)
    if module is None:
        try:
            import torch.nested._internal.nested_tensor as module
        except ImportError:
            return None
    return getattr(module, "NestedTensor", None)


def is_jagged(value):
    return isinstance(value, torch.Tensor) and value.is_nested and value.layout == torch.jagged


class Parts:
    """What a jagged nested tensor is made of, read without computing or caching anything."""

    __slots__ = ("values", "offsets", "lengths", "ragged_idx", "min_seqlen", "max_seqlen")


def parts(nt):
    """The parts of jagged nested tensor `nt`; raises TypeError naming what this torch lacks."""
    p = Parts()
    try:
        p.values = nt._values
        p.offsets = nt._offsets
        p.lengths = nt._lengths
        p.ragged_idx = nt._ragged_idx
        cache = nt._metadata_cache
    except AttributeError as e:
        raise TypeError(f"this torch's jagged nested tensor has no {e.name or e}") from None
    p.min_seqlen = _cached(cache, "min_seqlen")
    p.max_seqlen = _cached(cache, "max_seqlen")
    return p


def _cached(cache, key):
    # Read from the cache only: nt._min_seqlen would compute it (a sync on CUDA) and cache it,
    # changing the root's tensor.
    t = cache.get(key) if isinstance(cache, dict) else None
    if t is None:
        return None
    if isinstance(t, torch.Tensor):
        return int(t.shape[0]) if t.dim() >= 1 else int(t.item())
    return int(t)


def build(values, offsets, lengths, ragged_idx, min_seqlen, max_seqlen):
    """A jagged nested tensor of these parts; the caller has checked them."""
    return torch.nested.nested_tensor_from_jagged(values, offsets, lengths, jagged_dim=ragged_idx,
                                                  min_seqlen=min_seqlen, max_seqlen=max_seqlen)
