"""Property-based fuzz target of a follower's Python decoder (hypothesis): real envelopes -
the batches of batches.py, LeaderLoader step envelopes, the root's error envelopes - are
mutated (leaves replaced, their bytes flipped, containers truncated or cut, tags changed,
subtrees spliced in from other envelopes), converted as a follower converts what the core
rebuilt (_C.through_wire) and decoded, as spbcast.broadcast and LeaderLoader decode them. The
property: decoding returns or raises spbcast.Error - nothing else - and allocates nothing the
input did not pay for (the address space is capped, so a large allocation is a MemoryError).

The core's frame bytes are fuzzed by scripts/fuzz.sh (libFuzzer); this target starts where the
core hands the tree over. Run it with scripts/fuzz_python.sh [seconds]; keep what it finds as a
regression case in test_decoder.py.

    python python/tests/fuzz_decoder.py [seconds]
"""

import os
import resource
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

import spbcast  # noqa: E402
from spbcast import _C, _wire  # noqa: E402

import batches  # noqa: E402 - allows its classes, as every rank of a program would

W = _wire
_TAGS = [W.TAG_TUPLE, W.TAG_BYTES, W.TAG_OBJECT, W.TAG_SET, W.TAG_FROZENSET, W.TAG_ENUM,
         W.TAG_NAMEDTUPLE, W.TAG_SIZE, W.TAG_ORDERED_DICT, W.TAG_DEFAULTDICT, W.TAG_NUMPY_ARRAY,
         W.TAG_NUMPY_SCALAR, W.TAG_SURROGATE_STR, W.TAG_JAGGED, W.TAG_TENSORDICT, W.TAG_NON_TENSOR_DATA,
         W.TAG_NON_TENSOR_STACK, W.KIND_VALUE, W.KIND_ERROR, W.WIRE_VERSION, 17, -1]


def corpus():
    """Real envelopes, as a root encodes them."""
    warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
    values = [batches.xtuner_batch(1, length=64, micro=2, media=16),
              batches.xtuner_batch(2, length=64, micro=1, plain=True, media=0),
              batches.every_kind(3),
              {"paths": ["ok.jpg", "bad\udcff.jpg"], "n": 2**40, "b": b"\xff\x00"}]
    try:
        values.append(batches.new_kinds(4))
    except ImportError:  # numpy absent: its kinds are not sent
        pass
    values.append(nested_values())
    envelopes = [W.encode(v, 0) for v in values]
    # LeaderLoader's step envelopes: a batch, a refused batch, the end of a pass.
    for step, batch in enumerate(values[:2]):
        envelopes.append(W.encode({"error": None, "epoch": 1, "step": step, "words": 624 * step,
                                   "done": False, "batch": W.encode(batch, 0)[3]}, 0))
    envelopes.append(W.encode({"error": "spbcast: the batch was refused", "epoch": 0, "step": 3,
                               "words": 7, "done": False, "batch": None}, 0))
    envelopes.append(W.encode({"error": None, "epoch": 0, "step": 4, "words": 0, "done": True,
                               "batch": None}, 0))
    envelopes.append(W.error_envelope(spbcast.Error("spbcast: rank 0: cannot send batch", "loader")))
    return envelopes


def nested_values():
    """Jagged nested tensors (lengths, a second ragged dimension, int32 offsets, cached sequence
    lengths) and, where tensordict is installed, a TensorDict of them with non-tensor data."""
    jagged = torch.nested.nested_tensor_from_jagged
    offsets = torch.tensor([0, 2, 5])
    value = {"plain": jagged(torch.arange(10.0).reshape(5, 2), offsets, max_seqlen=3),
             "narrow": torch.nested.narrow(torch.zeros(2, 4), 1, torch.tensor([0, 1]), torch.tensor([2, 3]),
                                           layout=torch.jagged),
             "ragged_2": jagged(torch.zeros(3, 5, 2), offsets, jagged_dim=2),
             "int32": jagged(torch.ones(4), torch.tensor([0, 4], dtype=torch.int32), min_seqlen=4)}
    try:
        import tensordict as td
    except ImportError:  # tensordict absent: its kinds are not sent
        return value
    value["td"] = td.TensorDict({"ids": jagged(torch.arange(5), offsets), "mask": torch.ones(2, 3),
                                 "sub": td.TensorDict({"x": torch.zeros(2)}, batch_size=[2], names=["b"]),
                                 "meta": td.NonTensorData({"n": 1}),
                                 "uids": td.NonTensorStack.from_list(["a", "b"])}, batch_size=[2])
    return value


CORPUS = corpus()


def nodes(tree, out):
    """Every node of tree, in a fixed (preorder) order."""
    out.append(tree)
    if type(tree) in (list, tuple):
        for v in tree:
            nodes(v, out)
    elif type(tree) is dict:
        for v in tree.values():
            nodes(v, out)
    return out


def replace(tree, target, make, counter):
    """tree with its node number `target` (preorder) replaced by make(node)."""
    index = counter[0]
    counter[0] += 1
    if index == target:
        return make(tree)
    t = type(tree)
    if t is list or t is tuple:
        out = [replace(v, target, make, counter) for v in tree]
        return out if t is list else tuple(out)
    if t is dict:
        return {k: replace(v, target, make, counter) for k, v in tree.items()}
    return tree


def flip(data, draw):
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            data.append(draw(st.integers(0, 255)))
        else:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data)


_INTS = st.one_of(st.sampled_from(_TAGS), st.sampled_from([0, 1, -1, 2**31, 2**40, 2**62, 2**63 - 1,
                                                           -(2**63)]),
                  st.integers(-(2**63), 2**63 - 1))
_TEXT = st.text(st.characters(exclude_categories=("Cs",)), max_size=12)
_DTYPES = st.sampled_from(["<i3", "<M8[abc]", "|S0", "|V0", "<U0", "|O8", "<f8", "|u1", "<M8[ns]",
                           "|S3", "<U2", ">c16", "|b1", "<V2", "<i8", "=f4", "<f16"])


_TENSORS = st.builds(lambda n, dt: torch.zeros(n, dtype=dt),
                     st.one_of(st.sampled_from([0, 1, 3, 8, 16]), st.integers(0, 64)),
                     st.sampled_from([torch.uint8, torch.uint8, torch.float32, torch.int64]))
# Offsets and lengths: small, sorted or not, of an index dtype or not.
_OFFSETS = st.builds(lambda xs, dt: torch.tensor(xs).to(dt),  # int32: wrapped, as sent
                     st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, -1, 2**40, 2**62]), max_size=5),
                     st.sampled_from([torch.int64, torch.int64, torch.int32, torch.float32]))
_SHAPES = st.lists(st.sampled_from([0, 1, 2, 3, 8, 2**31, 2**40, 2**62, -1]), max_size=3)


def leaf():
    tensors, shapes = _TENSORS, _SHAPES
    return st.one_of(
        st.none(), st.booleans(), _INTS, st.floats(), _TEXT, st.binary(max_size=8), tensors,
        st.tuples(st.just(W.TAG_BYTES), st.binary(max_size=8)),
        st.tuples(st.just(W.TAG_SURROGATE_STR), st.binary(max_size=8)),
        st.tuples(st.just(W.TAG_NUMPY_ARRAY), _DTYPES, shapes, tensors),
        st.tuples(st.just(W.TAG_NUMPY_SCALAR), _DTYPES, st.tuples(st.just(W.TAG_BYTES), st.binary(max_size=16))),
        st.tuples(st.sampled_from([W.TAG_OBJECT, W.TAG_ENUM, W.TAG_NAMEDTUPLE]),
                  st.sampled_from(["batches", "batches.__main__", "batches.__init__", "__main__",
                                   ".batches", "batches..x", "os", "spbcast_canary", "tempfile"]),
                  st.sampled_from(["Plain", "Color", "Point", "Outer.Inner", "Slotted", "__class__",
                                   "_TemporaryFileWrapper", "Missing", ""]),
                  st.one_of(st.dictionaries(_TEXT, _INTS, max_size=2), _TEXT, st.none(),
                            st.lists(_INTS, max_size=2))),
        st.tuples(st.just(W.TAG_JAGGED), tensors, st.one_of(tensors, _OFFSETS), st.one_of(st.none(), _OFFSETS),
                  _INTS, st.one_of(st.none(), _INTS), st.one_of(st.none(), _INTS), st.booleans()),
        st.tuples(st.just(W.TAG_TENSORDICT), st.dictionaries(_TEXT, tensors, max_size=2), shapes,
                  st.sampled_from([None, "cpu", "cuda", "meta"]), st.one_of(st.none(), st.lists(_TEXT, max_size=2)),
                  st.booleans()),
        st.tuples(st.just(W.TAG_NON_TENSOR_DATA), _INTS, shapes, st.sampled_from([None, "cpu"])),
        st.tuples(st.just(W.TAG_NON_TENSOR_STACK),
                  st.lists(st.tuples(st.just(W.TAG_NON_TENSOR_DATA), _INTS, shapes, st.none()), max_size=2),
                  _INTS, shapes),
        st.tuples(st.just(W.TAG_DEFAULTDICT), st.one_of(st.none(), _TEXT, st.just(["batches", "Plain"])),
                  st.just({})),
    )


@st.composite
def mutated(draw):
    tree = draw(st.sampled_from(CORPUS))
    for _ in range(draw(st.integers(1, 6))):
        all_nodes = nodes(tree, [])
        target = draw(st.integers(0, len(all_nodes) - 1))
        node = all_nodes[target]
        op = draw(st.sampled_from(["leaf", "flip", "truncate", "drop", "tag", "splice", "wrap", "tensor",
                                   "numpy"]))
        if op == "leaf":
            new = draw(leaf())
        elif op == "numpy":  # the numpy kinds, whose dtype, shape and bytes must agree
            new = (draw(st.sampled_from([W.TAG_NUMPY_ARRAY, W.TAG_NUMPY_ARRAY, W.TAG_NUMPY_SCALAR])),
                   draw(_DTYPES), draw(_SHAPES), draw(_TENSORS))
            if new[0] == W.TAG_NUMPY_SCALAR:
                new = new[:2] + ((W.TAG_BYTES, draw(st.binary(max_size=16))),)
        elif op == "flip" and type(node) in (bytes, str):
            raw = node if type(node) is bytes else node.encode("utf-8", "surrogatepass")
            new = flip(raw, draw)  # bytes: an IValue str to the C++ side, UTF-8 or not
        elif op in ("truncate", "drop") and type(node) in (list, tuple) and node:
            items = list(node)
            if op == "truncate":
                items = items[:draw(st.integers(0, len(items) - 1))]
            else:
                del items[draw(st.integers(0, len(items) - 1))]
            new = items if type(node) is list else tuple(items)
        elif op in ("truncate", "drop") and type(node) is dict and node:
            keys = list(node)
            gone = keys[draw(st.integers(0, len(keys) - 1))]
            new = {k: v for k, v in node.items() if k != gone}
        elif op == "tag" and type(node) is tuple and node:
            new = (draw(_INTS),) + node[1:]
        elif op == "splice":
            other = nodes(draw(st.sampled_from(CORPUS)), [])
            new = other[draw(st.integers(0, len(other) - 1))]
        elif op == "wrap":
            new = draw(st.sampled_from([lambda v: [v], lambda v: (W.TAG_TUPLE, v), lambda v: {"k": v},
                                        lambda v: (W.TAG_SET, [v]), lambda v: (W.TAG_SIZE, [v])]))(node)
        elif op == "tensor" and type(node) is torch.Tensor:
            n = draw(st.integers(0, node.numel() + 16))
            new = torch.zeros(n, dtype=draw(st.sampled_from([torch.uint8, node.dtype])))
        else:
            new = draw(leaf())
        tree = replace(tree, target, lambda _, new=new: new, [0])
    return tree


def decode_as_a_follower(tree):
    """What spbcast.broadcast and LeaderLoader run on a follower for the tree the core rebuilt;
    returns, or raises spbcast.Error."""
    received = _C.through_wire(tree)
    body = W.open_envelope(received, 1, 0)
    value = W.decode_body(body, 1)
    if type(body) is dict and set(body) >= {"batch"}:  # a LeaderLoader step: its batch too
        W.decode_body(body["batch"], 1)
    return value


def check(tree):
    try:
        decode_as_a_follower(tree)
    except spbcast.Error:
        pass


def property_test(examples):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated())
    def decoding_returns_or_raises_spbcast_errors(tree):
        check(tree)
    return decoding_returns_or_raises_spbcast_errors


def cap_address_space(extra=1 << 31):
    """Caps this process's address space at what it maps now plus `extra`, so that an
    allocation the input did not pay for fails (MemoryError: a finding) instead of succeeding on
    a host that overcommits."""
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    resource.setrlimit(resource.RLIMIT_AS, (mapped + extra, resource.getrlimit(resource.RLIMIT_AS)[1]))


def main(seconds):
    cap_address_space()
    start, examples = time.monotonic(), 0
    while time.monotonic() - start < seconds:
        property_test(200)()
        examples += 200
    print(f"fuzz_python: no findings in {examples} examples, {time.monotonic() - start:.0f} s, "
          f"from {len(CORPUS)} envelopes")


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else 60.0)
