"""Batches for the tests (every rank builds the same ones from a seed) and a bit-exact compare.

The classes live at module level so that every rank can find them by module and name, and are
allowed at import time - the documented pattern: every rank imports this module.
"""

import collections
import dataclasses
import enum
import struct
from typing import List, NamedTuple, Optional

import torch

import spbcast


@dataclasses.dataclass
class SequenceContext:
    """XTuner v1's SequenceContext, as a dataclass (shared/batches.md)."""
    input_ids: torch.Tensor
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    max_length_q: torch.Tensor
    max_length_k: torch.Tensor
    num_padding: int
    position_ids: torch.Tensor
    pixel_values: Optional[torch.Tensor] = None
    image_grid_thw: Optional[torch.Tensor] = None
    num_img_tokens: Optional[List[List[int]]] = None
    inputs_embeds: Optional[torch.Tensor] = None
    device: str = "cpu"


class PlainSequenceContext:
    """The same fields on a plain class whose __init__ must not run on followers."""

    def __init__(self, **fields):
        raise AssertionError("spbcast must rebuild objects without calling __init__")


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: int
    b: torch.Tensor


@dataclasses.dataclass(slots=True)
class Slotted:
    x: float
    y: list


class Plain:
    pass


class Outer:
    class Inner:  # a nested class: found again by its qualified name
        pass


class Color(enum.Enum):
    RED = 1
    GREEN = "g"


class Perm(enum.IntFlag):
    R = 4
    W = 2


Point = collections.namedtuple("Point", "x y")


class Typed(NamedTuple):
    a: int
    b: str = "z"


@dataclasses.dataclass
class DSATopKCacheState:
    """Like the one in XTuner's real batches: its released_sources is an empty set()."""
    released_sources: set = dataclasses.field(default_factory=set)
    topk_indices: Optional[torch.Tensor] = None
    per_layer: dict = dataclasses.field(default_factory=dict)


spbcast.allow_classes(SequenceContext, PlainSequenceContext, Frozen, Slotted, Plain, Outer.Inner,
                      Color, Perm, Point, Typed, DSATopKCacheState)


def _packed_ctx(g, length, plain, media):
    lengths = [int(x) for x in torch.randint(1, length // 4, (3,), generator=g)]
    used = sum(lengths)
    num_padding = length - used
    seg = lengths + [256] * (num_padding // 256) + ([num_padding % 256] if num_padding % 256 else [])
    cu = torch.tensor([0] + list(torch.tensor(seg).cumsum(0)), dtype=torch.int32)
    ids = torch.randint(0, 150000, (1, length), generator=g)
    pos = torch.arange(length).reshape(1, 1, length).expand(3, 1, length)  # stride-0 view
    fields = dict(
        input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,  # the SAME tensor object
        max_length_q=torch.tensor(max(seg)), max_length_k=torch.tensor(max(seg)),
        num_padding=num_padding, position_ids=pos,
        pixel_values=None, image_grid_thw=None, num_img_tokens=[[0], [0], [0]],
        inputs_embeds=None, device="cpu")
    if media:
        patches = media
        fields["pixel_values"] = torch.randn(patches, 1536, generator=g)
        fields["image_grid_thw"] = torch.tensor([[1, 16, patches // 16]])
        fields["num_img_tokens"] = [[patches // 4], [0], [0]]
    if plain:
        ctx = object.__new__(PlainSequenceContext)
        ctx.__dict__.update(fields)
        return ctx, ids
    return SequenceContext(**fields), ids


def xtuner_batch(seed, length=4096, micro=2, plain=False, media=512):
    """A collated XTuner batch: [{seq_ctx, shifted_labels}] x micro."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(micro):
        ctx, ids = _packed_ctx(g, length, plain, media)
        labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
        labels[:, -ctx.num_padding:] = -100
        out.append({"seq_ctx": ctx, "shifted_labels": labels})
    return out


def every_dtype():
    names = ["bool", "uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16",
             "float32", "float64", "complex32", "complex64", "complex128", "uint16", "uint32",
             "uint64", "float8_e5m2", "float8_e4m3fn", "float8_e5m2fnuz", "float8_e4m3fnuz",
             "float8_e8m0fnu"]
    return [getattr(torch, n) for n in names if hasattr(torch, n)]


def _random_bytes(g, n):
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def every_kind(seed):
    """Every kind of value the package sends, nested, with aliases and views."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for dt in every_dtype():
        raw = _random_bytes(g, 6 * 4 * torch.empty((), dtype=dt).element_size())
        tensors[str(dt)] = raw.view(dt).reshape(6, 4)
    f = torch.tensor([float("nan"), -0.0, float("inf"), 1.5])
    f.view(torch.int32)[0] = 0x7FC01234  # a NaN payload
    base = torch.randn(8, 6, generator=g)
    shared = torch.arange(10.0)
    frozen = Frozen(a=3, b=shared)
    plain = Plain()
    plain.name = "plain"
    plain.inner = Outer.Inner()
    plain.inner.values = (1, 2)
    plain.shared = shared
    slotted = Slotted(x=-0.0, y=[frozen])
    grad = torch.randn(3, generator=g).requires_grad_()
    z = torch.randn(4, dtype=torch.complex64, generator=g)
    return {
        "dtypes": tensors,
        "views": {
            "base": base, "t": base.t(), "slice": base[2:5, 1::2], "expand": base[0:1].expand(4, 6),
            "scalar": torch.tensor(7), "empty": torch.empty(0, 3), "empty_view": base[8:],
            "nan": f, "grad": grad, "non_leaf": grad * 2, "no_grad_leaf": torch.ones(2),
            "conj": z.conj(), "neg": z.conj().imag, "z": z,
        },
        "shared_twice": [shared, shared, frozen, plain],
        "scalars": [0, -1, 2**63 - 1, -(2**63), 1.5, -0.0, float("inf"), float("nan"), True,
                    False, None, "", "ünïcode ✓", b"", bytes(range(256))],
        "nested": ((), [], {}, ((1,), [2, (3, [4])]), {"k": ({"d": [None]},)}),
        "int_keys": {3: "three", -1: None, 2**40: [1]},
        "objects": [frozen, plain, slotted, xtuner_batch(seed, 512, 1, media=0)[0]["seq_ctx"]],
    }


def new_kinds(seed):
    """The kinds beyond the core vocabulary: sets, enums, named tuples, torch.Size, OrderedDict,
    defaultdict, numpy arrays and scalars (numpy needed), and XTuner's DSATopKCacheState."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    rnd = np.random.default_rng(seed)
    arrays = {}
    for dt in ["i1", "u1", "<i2", ">i2", "<i4", "<u4", "<i8", ">u8", "<f2", "<f4", ">f8", "<c8",
               "<c16", np.longdouble, "<M8[ns]", "<m8[s]", "M8[D]", "|S3", "|V4"]:
        dt = np.dtype(dt)
        raw = rnd.integers(0, 256, size=6 * dt.itemsize, dtype=np.uint8)
        arrays[dt.str] = raw.view(dt).reshape(2, 3)  # NaN payloads, every bit pattern
    arrays["bool"] = rnd.integers(0, 2, size=(4,)).astype(bool)
    arrays["str"] = np.array([["ab", "ü"], ["", "xyz"]])
    base = rnd.standard_normal((4, 6))
    readonly = np.arange(5)
    readonly.flags.writeable = False
    ids = torch.randint(0, 100, (3,), generator=g)
    ctx = xtuner_batch(seed, 512, 1, media=0)[0]
    ctx["seq_ctx"].dsa_state = DSATopKCacheState()  # released_sources: an empty set
    return {
        "sets": {"strs": {"a", "b", "ünï", "", f"s{seed}"}, "ints": {1, -5, 2**40, seed},
                 "mixed": {None, True, 1.5, "x", b"y", (1, "t"), frozenset({"q", "r"}),
                           Color.RED, Point(1, "p")},
                 "empty": set(), "frozen": frozenset({3, 4}), "empty_frozen": frozenset()},
        "enums": [Color.RED, Color.GREEN, Perm.R, Perm.R | Perm.W, Perm(0)],
        "named": [Point(seed, [ids, ids]), Typed(3), Typed(4, "w"), Point(Point(1, 2), None)],
        "sizes": [torch.Size([2, 3]), torch.Size([])],
        "ordered": collections.OrderedDict([(3, "c"), (1, "a"), (2, ids)]),
        "ordered_empty": collections.OrderedDict(),
        "defaults": [collections.defaultdict(list, {"a": [1]}), collections.defaultdict(int),
                     collections.defaultdict(None, {"k": 1}), collections.defaultdict(Plain),
                     collections.defaultdict(set, {"s": {"x"}})],
        "arrays": arrays,
        "layouts": {"0d": np.array(2.5), "empty": np.zeros((0, 3)), "t": base.T, "step": base[:, ::2],
                    "fortran": np.asfortranarray(base), "readonly": readonly, "rows": base[1:3],
                    "twice": [base, base]},
        "np_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True), np.float64("nan"),
                       np.str_("hé"), np.bytes_(b"x\x00"), np.datetime64("2020-01-01", "D"),
                       np.complex64(1 + 2j), np.uint8(255), np.float16(-0.0)],
        "xtuner": ctx,
    }


# ---- bit-exact comparison ---------------------------------------------------------------------

def tensor_bytes(t):
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)


def _same_float(a, b):
    return struct.pack("<d", a) == struct.pack("<d", b)


def assert_same(expected, got, path="batch", tensors=None):
    """expected and got are equal bit for bit, with the same types, classes and tensor layout;
    with tensors=[], the (expected, got) tensor pairs are collected for assert_same_aliasing."""
    top = tensors is None
    if top:
        tensors = []
    te, tg = type(expected), type(got)
    assert te is tg, f"{path}: type {tg.__name__}, expected {te.__name__}"
    if te is torch.Tensor:
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{path}: shape {got.shape} != {expected.shape}"
        assert got.stride() == expected.stride(), f"{path}: stride {got.stride()} != {expected.stride()}"
        assert got.requires_grad == expected.requires_grad, f"{path}: requires_grad"
        assert got.is_conj() == expected.is_conj() and got.is_neg() == expected.is_neg(), f"{path}: conj/neg bit"
        assert got.device.type == "cpu", f"{path}: device {got.device}"
        assert torch.equal(tensor_bytes(got), tensor_bytes(expected)), f"{path}: values differ"
        tensors.append((expected, got, path))
    elif te is float:
        assert _same_float(expected, got), f"{path}: {got!r} != {expected!r}"
    elif isinstance(expected, enum.Enum):
        assert got is expected, f"{path}: {got!r} is not {expected!r}"
    elif te.__module__ == "numpy":
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{path}: shape {got.shape} != {expected.shape}"
        assert got.tobytes() == expected.tobytes(), f"{path}: values differ"
    elif issubclass(te, (list, tuple)):  # named tuples and torch.Size too
        assert len(got) == len(expected), f"{path}: length {len(got)} != {len(expected)}"
        for i, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{path}[{i}]", tensors)
    elif issubclass(te, dict):  # OrderedDict and defaultdict too
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        assert getattr(got, "default_factory", None) is getattr(expected, "default_factory", None), path
        for k in expected:
            assert_same(expected[k], got[k], f"{path}[{k!r}]", tensors)
    elif te in (set, frozenset):
        assert got == expected, f"{path}: {got!r} != {expected!r}"
        kinds = lambda s: sorted(f"{type(x).__qualname__}:{x!r}" for x in s)  # noqa: E731
        assert kinds(got) == kinds(expected), f"{path}: element types differ"
    elif te in (int, bool, str, bytes, type(None)):
        assert got == expected, f"{path}: {got!r} != {expected!r}"
    elif isinstance(expected, torch.Tensor) and expected.is_nested:
        _same_jagged(expected, got, path, tensors)
    elif te.__module__.split(".")[0] == "tensordict":
        _same_tensordict(expected, got, path, tensors)
    else:
        fe = _state(expected)
        fg = _state(got)
        assert list(fg) == list(fe), f"{path}: attributes {list(fg)} != {list(fe)}"
        for k in fe:
            assert_same(fe[k], fg[k], f"{path}.{k}", tensors)
    if top:
        assert_same_aliasing(tensors)


def _ragged_shape(t):
    # A ragged size is a nested int, one per offsets tensor and process: where, not which.
    return [d if type(d) is int else "ragged" for d in t.shape]


def _same_jagged(expected, got, path, tensors):
    """Jagged nested tensors equal in all a trainer observes: the parts bit for bit (their
    identity and storage sharing with the batch's other tensors too), the ragged dimension,
    the shape, dtype, requires_grad, and the cached min/max sequence lengths (absent or equal)."""
    assert got.layout == expected.layout == torch.jagged, f"{path}: layout {got.layout}"
    assert got._ragged_idx == expected._ragged_idx, f"{path}: ragged dimension"
    assert _ragged_shape(got) == _ragged_shape(expected), f"{path}: shape {got.shape} != {expected.shape}"
    assert got.dtype == expected.dtype and got.requires_grad == expected.requires_grad, path
    assert got.is_leaf == expected.is_leaf, f"{path}: is_leaf"
    assert got.is_contiguous() == expected.is_contiguous(), f"{path}: contiguity"
    for key in ("min_seqlen", "max_seqlen"):
        e, g = expected._metadata_cache.get(key), got._metadata_cache.get(key)
        assert (e is None) == (g is None), f"{path}: cached {key} present {g is not None}"
        if e is not None:
            assert e.shape == g.shape, f"{path}: cached {key} {g.shape[0]} != {e.shape[0]}"
    assert (got.lengths() is None) == (expected.lengths() is None), f"{path}: lengths"
    assert_same(expected._values, got._values, f"{path}._values", tensors)
    assert_same(expected.offsets(), got.offsets(), f"{path}.offsets()", tensors)
    if expected.lengths() is not None:
        assert_same(expected.lengths(), got.lengths(), f"{path}.lengths()", tensors)
    assert torch.equal(tensor_bytes(got.values().detach()), tensor_bytes(expected.values().detach())), path
    for i, (e, g) in enumerate(zip(expected.unbind(), got.unbind())):
        assert e.shape == g.shape and torch.equal(tensor_bytes(e.detach()), tensor_bytes(g.detach())), \
            f"{path}.unbind()[{i}]"


def _same_tensordict(expected, got, path, tensors):
    """TensorDict, NonTensorData, NonTensorStack: the same class, batch_size, device, names,
    keys in order, lock and entries."""
    assert got.batch_size == expected.batch_size, f"{path}: batch_size {got.batch_size} != {expected.batch_size}"
    assert got.device == expected.device, f"{path}: device {got.device} != {expected.device}"
    name = type(expected).__name__
    if name == "NonTensorData":
        assert_same(expected.data, got.data, f"{path}.data", tensors)
    elif name == "NonTensorStack":
        assert got.stack_dim == expected.stack_dim, f"{path}: stack_dim"
        assert_same(list(expected.tensordicts), list(got.tensordicts), f"{path}.tensordicts", tensors)
    else:
        assert got.names == expected.names, f"{path}: names {got.names} != {expected.names}"
        assert got.is_locked == expected.is_locked, f"{path}: is_locked"
        e, g = dict(expected.items()), dict(got.items())
        assert list(g) == list(e), f"{path}: keys {list(g)} != {list(e)}"
        for k in e:
            assert_same(e[k], g[k], f"{path}[{k!r}]", tensors)


def _state(obj):
    if dataclasses.is_dataclass(obj) and not hasattr(obj, "__dict__"):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return dict(vars(obj))


def assert_same_aliasing(pairs):
    """Identity and storage sharing among the received tensors is that among the sent ones."""
    for i, (ei, gi, pi) in enumerate(pairs):
        for ej, gj, pj in pairs[i + 1:]:
            assert (ei is ej) == (gi is gj), f"{pi} and {pj}: tensor identity differs"
            se = ei.untyped_storage().data_ptr() == ej.untyped_storage().data_ptr()
            sg = gi.untyped_storage().data_ptr() == gj.untyped_storage().data_ptr()
            if ei.numel() and ej.numel():
                assert se == sg, f"{pi} and {pj}: storage sharing differs (sent {se}, got {sg})"
                if se:
                    de = ei.storage_offset() * ei.element_size() - ej.storage_offset() * ej.element_size()
                    dg = gi.storage_offset() * gi.element_size() - gj.storage_offset() * gj.element_size()
                    assert de == dg, f"{pi} and {pj}: relative storage offset differs"


def payload_mib(value):
    seen, total = set(), 0
    def walk(v):
        nonlocal total
        if isinstance(v, torch.Tensor):
            s = v.untyped_storage()
            if s.data_ptr() not in seen:
                seen.add(s.data_ptr())
                total += s.nbytes()
        elif isinstance(v, (list, tuple)):
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for x in v.values():
                walk(x)
        elif hasattr(v, "__dict__"):
            walk(vars(v))
    walk(value)
    return total / 2**20
