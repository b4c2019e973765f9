#!/usr/bin/env python3
"""Benchmark the Python ways a user would broadcast a collated batch from the SP leader.

spbcast is measured against what a trainer written in Python would otherwise use to send the
leader's batch to the other ranks of a sequence-parallel group over c10d Gloo:

  pickle      torch.distributed.broadcast_object_list([batch]) - pickles the whole batch.
  accelerate  HF accelerate's dispatch pattern (DataLoaderDispatcher): the structure (nesting,
              shapes, dtypes, Python values) goes with broadcast_object_list, the followers
              allocate empty tensors, then one torch.distributed.broadcast per tensor reference.
              accelerate itself is not needed: its broadcast() refuses non-tensor leaves such as
              None, so the pattern is reimplemented here with the same collectives.
  tensordict  TensorDict.broadcast (tensordict >= 0.15): consolidate into one storage, send its
              metadata with broadcast_object_list and the storage with one broadcast.
  spbcast-py  spbcast.broadcast from Python (the package in python/, installed by
              scripts/setup.sh): the C++ core behind a torch extension, over the same group.

Batches are the profiles of shared/batches.md, ported from examples/common/profiles.hpp.

Every cell (profile x micro-batches x world size) runs as `world_size` fresh processes on a
loopback Gloo group (rank 0 is the root), measures each method in turn, and tears down. The
parent re-runs this file with a hidden --_worker argument for each rank and kills the ranks it
started if they outlive --cell-timeout; collectives time out after --pg-timeout. A method
whose cell is estimated not to fit in memory (pickle at 8 ranks on the long video profile, on a
24 GiB machine) is recorded as skipped instead of being left to the OOM killer.

Each row of the JSON says how fast (median over --repeats timed steps of the slowest rank),
how much extra resident memory the leader and the followers needed, how many collectives a
step issues, and whether the followers got the root's data exactly (checked once per cell and
method; wrong data is reported as an error and not timed). ROW_KEYS lists the fields.

Example:
  python bench/python_peers.py --profiles text,qwen3-vl-image --micro-batches 1 \
      --world-sizes 2 --repeats 3 --json /tmp/peers.json
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import gc
import json
import os
import pickle
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ALL_METHODS = ("pickle", "accelerate", "tensordict", "spbcast-py")


# --------------------------------------------------------------------------------------------
# Batches: a port of examples/common/profiles.hpp (keep the two in step).
# --------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class ProfileShape:
    pack_length: int
    media_rows: int   # patches (qwen3-vl) or tiles (interns1); 0 for text
    tiles: bool       # InternS1 (tiles, 3, 448, 448) instead of (patches, 1536)
    rope_3d: bool     # Qwen3-VL's (3, 1, L) position ids


PROFILES = {
    "text": ProfileShape(32768, 0, False, False),
    "qwen3-vl-image": ProfileShape(32768, 8192, False, True),
    "interns1-tiles": ProfileShape(16384, 12, True, False),
    "qwen3-vl-video-long": ProfileShape(131072, 32768, False, True),
}


def make_item(shape: ProfileShape, gen):
    """One packed micro-batch, drawn from `gen` in the same order as the C++ make_item."""
    import torch

    i64 = torch.int64
    L = shape.pack_length

    cu = [0]
    used = 0
    min_len, max_len = 512, L // 3
    while True:
        length = min_len + int(torch.randint(max_len - min_len, (1,), generator=gen, dtype=i64))
        if used + length > L - 256:
            break
        used += length
        cu.append(used)
    num_sequences = len(cu) - 1
    num_padding = L - used
    pad = num_padding
    while pad > 0:  # padding is split into 256-token segments
        cu.append(cu[-1] + min(pad, 256))
        pad -= 256

    input_ids = torch.randint(151000, (1, L), generator=gen, dtype=i64)
    input_ids.narrow(1, used, L - used).fill_(151643)
    cu_seq_lens_q = torch.tensor(cu, dtype=torch.int32)
    longest = max(cu[i] - cu[i - 1] for i in range(1, len(cu)))
    positions = torch.arange(L, dtype=i64).view(1, 1, L)
    # Qwen3-VL's 3-D rope ids are an expand: stride 0 over the 3 axes, one L-long storage.
    position_ids = positions.expand(3, 1, L) if shape.rope_3d else positions.view(1, L)
    shifted_labels = torch.randint(151000, (1, L), generator=gen, dtype=i64)
    shifted_labels.narrow(1, used, L - used).fill_(-100)

    pixel_values = image_grid_thw = num_img_tokens = None
    if shape.media_rows > 0:
        if shape.tiles:
            pixel_values = torch.randn(shape.media_rows, 3, 448, 448, generator=gen)
        else:
            pixel_values = torch.randn(shape.media_rows, 1536, generator=gen)
            per_image = 1024  # 32x32 patch grids
            images = shape.media_rows // per_image
            image_grid_thw = torch.tensor([1, 32, 32], dtype=i64).repeat(images, 1)
        num_img_tokens = [[shape.media_rows // 4] if s == 0 else [0] for s in range(num_sequences)]

    seq_ctx = {
        "input_ids": input_ids,
        "cu_seq_lens_q": cu_seq_lens_q,
        "cu_seq_lens_k": cu_seq_lens_q,  # the same tensor object, as XTuner builds it
        "max_length_q": torch.scalar_tensor(longest, dtype=i64),
        "max_length_k": torch.scalar_tensor(longest, dtype=i64),
        "num_padding": num_padding,
        "position_ids": position_ids,
        "pixel_values": pixel_values,
        "image_grid_thw": image_grid_thw,
        "num_img_tokens": num_img_tokens,
        "inputs_embeds": None,
        "block_table": None,
        "rollout_routed_experts": None,
        "device": "cpu",
    }
    return {"seq_ctx": seq_ctx, "shifted_labels": shifted_labels}


def iter_batch(profile: str, micro_batches: int, seed: int):
    """Yield the micro-batches one at a time from a private generator (the default CPU
    generator never moves), so a follower can check a received batch item by item without
    holding a second full copy."""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    for _ in range(micro_batches):
        yield make_item(PROFILES[profile], gen)


def make_batch(profile: str, micro_batches: int, seed: int):
    return list(iter_batch(profile, micro_batches, seed))


def tensor_refs(obj):
    """Every tensor reference in visit order (an alias appears as often as it is referenced)."""
    import torch

    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensor_refs(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from tensor_refs(value)


def payload_bytes(batch) -> int:
    """Bytes of tensor data the batch really holds: per distinct storage, the span its views
    touch (an alias or a second view of one storage is counted once; an expand counts its
    storage, not its logical size). This is the same number for every method of a cell."""
    spans: dict[int, tuple[int, int]] = {}
    for t in tensor_refs(batch):
        if t.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
        start = t.storage_offset() * t.element_size()
        end = start + extent * t.element_size()
        key = t.untyped_storage().data_ptr()
        lo, hi = spans.get(key, (start, end))
        spans[key] = (min(lo, start), max(hi, end))
    return sum(hi - lo for lo, hi in spans.values())


class _CountingSink:
    """A file object that only counts what is written, to size a pickle without keeping it."""

    def __init__(self):
        self.n = 0

    def write(self, data):
        self.n += len(data)
        return len(data)


def pickled_size(obj) -> int:
    sink = _CountingSink()
    pickle.Pickler(sink).dump(obj)  # the pickler broadcast_object_list uses
    return sink.n


# --------------------------------------------------------------------------------------------
# The methods. Each step takes the root's batch (None on followers) and returns what the rank
# holds afterwards; `collectives` says how many c10d collectives one step issues.
# --------------------------------------------------------------------------------------------

def pickle_step(batch, rank):
    import torch.distributed as dist

    box = [batch] if rank == 0 else [None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def pickle_collectives(batch) -> int:
    # broadcast_object_list: one broadcast of the sizes, one of the pickled bytes.
    return 2


def pickle_wire_bytes(batch) -> int:
    return pickled_size([batch])


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """A tensor's place in the structure, like accelerate's TensorInformation."""
    shape: tuple
    dtype: str


def _describe(obj, out):
    """The structure with every tensor replaced by its TensorInfo; the tensors, made contiguous
    as accelerate sends them, are appended to `out` in visit order (aliases not merged)."""
    import torch

    if isinstance(obj, torch.Tensor):
        out.append(obj.contiguous())
        return TensorInfo(tuple(obj.shape), str(obj.dtype).removeprefix("torch."))
    if isinstance(obj, dict):
        return {k: _describe(v, out) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_describe(v, out) for v in obj)
    return obj


def _allocate(structure, out):
    """A follower's empty copy of the structure; its new tensors go to `out` in visit order."""
    import torch

    if isinstance(structure, TensorInfo):
        t = torch.empty(structure.shape, dtype=getattr(torch, structure.dtype))
        out.append(t)
        return t
    if isinstance(structure, dict):
        return {k: _allocate(v, out) for k, v in structure.items()}
    if isinstance(structure, (list, tuple)):
        return type(structure)(_allocate(v, out) for v in structure)
    return structure


def accelerate_step(batch, rank):
    import torch.distributed as dist

    tensors = []
    if rank == 0:
        box = [_describe(batch, tensors)]
        dist.broadcast_object_list(box, src=0)
        result = batch
    else:
        box = [None]
        dist.broadcast_object_list(box, src=0)
        result = _allocate(box[0], tensors)
    for t in tensors:  # one broadcast per tensor reference, as accelerate's broadcast() does
        dist.broadcast(t, src=0)
    return result


def accelerate_collectives(batch) -> int:
    return 2 + sum(1 for _ in tensor_refs(batch))


def accelerate_wire_bytes(batch) -> int:
    tensors = []
    structure = _describe(batch, tensors)
    return pickled_size([structure]) + sum(t.numel() * t.element_size() for t in tensors)


def _to_tensordict(batch):
    """The batch as a TensorDict: micro-batch i under key "i", nested dicts as sub-tensordicts.
    Non-tensor values are wrapped in NonTensorData so they come back as the same Python values
    (left bare, TensorDict would turn num_padding and num_img_tokens into tensors)."""
    import torch
    from tensordict import NonTensorData, TensorDict

    def wrap(obj):
        if isinstance(obj, dict):
            return {k: wrap(v) for k, v in obj.items()}
        if isinstance(obj, torch.Tensor):
            return obj
        return NonTensorData(obj)

    return TensorDict({str(i): wrap(item) for i, item in enumerate(batch)}, batch_size=[])


def _from_tensordict(td):
    as_dict = td.to_dict()
    return [as_dict[str(i)] for i in range(len(as_dict))]


def tensordict_step(batch, rank):
    from tensordict import TensorDict

    if rank == 0:
        # broadcast() consolidates on the root (one copy of every leaf into one storage) and
        # returns that consolidated copy; the caller keeps using its own batch, so drop it.
        _to_tensordict(batch).broadcast(src=0)
        return batch
    return _from_tensordict(TensorDict().broadcast(src=0))


def tensordict_collectives(batch) -> int:
    # TensorDict.broadcast (tensordict/_base/distributed.py): broadcast_object_list of the
    # metadata (2 broadcasts) then one broadcast of the consolidated storage.
    return 3


def tensordict_wire_bytes(batch) -> int:
    td = _to_tensordict(batch).consolidate(metadata=True)
    metadata = dict(td._consolidated["metadata"])
    storage = td._consolidated["storage"]
    metadata["_total_bytes"] = storage.numel()
    metadata["_storage_device"] = str(storage.device)
    return pickled_size([metadata]) + storage.numel()


def spbcast_step(batch, rank):
    import spbcast

    return spbcast.broadcast(batch if rank == 0 else None, src=0)


def spbcast_collectives(batch):
    # Issued by the C++ core inside the extension, where Python does not see them; the C++
    # rows of the grid (method "spbcast") count them for the same batch.
    return None


def spbcast_wire_bytes(batch) -> int:
    # The tensor bytes (each storage once, aliases sent once); the metadata frame adds a few KiB.
    return payload_bytes(batch)


METHODS = {
    "pickle": (pickle_step, pickle_collectives, pickle_wire_bytes),
    "spbcast-py": (spbcast_step, spbcast_collectives, spbcast_wire_bytes),
    "accelerate": (accelerate_step, accelerate_collectives, accelerate_wire_bytes),
    "tensordict": (tensordict_step, tensordict_collectives, tensordict_wire_bytes),
}


def method_unavailable(method: str) -> str | None:
    """Why a method cannot run in this process, or None."""
    if method == "tensordict":
        try:
            import tensordict  # noqa: F401
            from tensordict import TensorDict
        except Exception as exc:  # noqa: BLE001 - any import failure means "skip"
            return f"tensordict not importable: {exc!r}"
        if not hasattr(TensorDict, "broadcast"):
            return f"tensordict {tensordict.__version__} has no TensorDict.broadcast"
    if method == "spbcast-py":
        try:
            import spbcast  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"the spbcast Python package is not importable (scripts/setup.sh installs it): {exc!r}"
    return None


# --------------------------------------------------------------------------------------------
# Correctness: followers rebuild the root's batch from the same seed, one micro-batch at a
# time, and compare exactly.
# --------------------------------------------------------------------------------------------

def first_mismatch(ref, got, path="batch"):
    import torch

    if isinstance(ref, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: expected a tensor, got {type(got).__name__}"
        if ref.dtype != got.dtype or ref.shape != got.shape:
            return f"{path}: expected {ref.dtype}{list(ref.shape)}, got {got.dtype}{list(got.shape)}"
        if not torch.equal(ref, got):
            return f"{path}: values differ"
        return None
    if isinstance(ref, dict):
        if not isinstance(got, dict) or set(ref) != set(got):
            return f"{path}: keys differ ({sorted(ref)} vs {sorted(got) if isinstance(got, dict) else type(got).__name__})"
        for key in ref:
            bad = first_mismatch(ref[key], got[key], f"{path}.{key}")
            if bad:
                return bad
        return None
    if isinstance(ref, (list, tuple)):
        if type(ref) is not type(got) or len(ref) != len(got):
            return f"{path}: expected {type(ref).__name__} of {len(ref)}, got {type(got).__name__} {got!r:.80}"
        for i, (r, g) in enumerate(zip(ref, got)):
            bad = first_mismatch(r, g, f"{path}[{i}]")
            if bad:
                return bad
        return None
    if type(ref) is not type(got) or ref != got:
        return f"{path}: expected {ref!r} ({type(ref).__name__}), got {got!r:.80} ({type(got).__name__})"
    return None


def check_received(got, profile, micro_batches, seed):
    """(mismatch or None, cu_seq_lens alias kept, expand kept or None) for a follower."""
    if not isinstance(got, list) or len(got) != micro_batches:
        return f"batch: expected a list of {micro_batches}, got {type(got).__name__}", False, None
    aliases, expands = True, None
    for i, ref in enumerate(iter_batch(profile, micro_batches, seed)):
        bad = first_mismatch(ref, got[i], f"batch[{i}]")
        if bad:
            return bad, False, None
        ctx = got[i]["seq_ctx"]
        aliases &= ctx["cu_seq_lens_k"] is ctx["cu_seq_lens_q"]
        if PROFILES[profile].rope_3d:
            expands = (expands is not False) and ctx["position_ids"].stride(0) == 0
    return None, aliases, expands


# --------------------------------------------------------------------------------------------
# Memory: resident set size of this process.
# --------------------------------------------------------------------------------------------

class PeakRss:
    """Peak RSS over a window of steps.

    Sampling RSS after each step misses what a step frees before it returns (the pickled
    buffer of broadcast_object_list, the consolidated copy of TensorDict), and ru_maxrss is a
    lifetime high-water mark that an earlier method would mask. So the kernel's own peak,
    VmHWM, is reset through /proc/self/clear_refs ("5", Linux >= 4.0) when a window opens and
    read when it closes. Where that file cannot be written, it falls back to the after-step
    samples (a lower bound) and says so in `exact`.
    """

    def __init__(self):
        self.exact = False
        self.sampled = 0

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    @staticmethod
    def _hwm() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        raise RuntimeError("no VmHWM in /proc/self/status")

    def start(self) -> int:
        """Release freed heap memory, open a window, return the baseline RSS."""
        gc.collect()
        try:
            # glibc keeps freed chunks below its mmap threshold in the heap; without a trim a
            # method could reuse what the previous one freed and show no growth at all.
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            self.exact = True
        except OSError:
            self.exact = False
        base = self.rss()
        self.sampled = base
        return base

    def sample(self):
        self.sampled = max(self.sampled, self.rss())

    def peak(self) -> int:
        return max(self._hwm(), self.sampled) if self.exact else self.sampled


# --------------------------------------------------------------------------------------------
# One rank of one cell.
# --------------------------------------------------------------------------------------------

def run_method(method, batch, rank, world, cfg, mem):
    """Measure one method on an initialized group; returns the row (meaningful on the root)."""
    import torch
    import torch.distributed as dist

    step, count_collectives, count_wire = METHODS[method]
    row = {"method": method, "repeats": cfg["repeats"], "warmup": cfg["warmup"]}

    # Every rank must agree the method can run before anyone enters its collectives.
    why = cfg["skip"].get(method) or method_unavailable(method)
    if rank == 0 and why is None:
        try:
            row["collectives"] = count_collectives(batch)
            row["wire_bytes"] = count_wire(batch)
        except Exception as exc:  # noqa: BLE001 - e.g. a batch the library cannot take
            why = f"cannot prepare the batch: {exc!r}"
    flag = torch.tensor([0 if why else 1])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    reasons = [None] * world
    dist.all_gather_object(reasons, why)
    if flag.item() == 0:
        if all(m == reasons[0] for m in reasons):
            reason = reasons[0]  # the same on every rank: say it once
        else:
            reason = "; ".join(f"rank {r}: {m}" for r, m in enumerate(reasons) if m)
        row.update(status="skipped", reason=reason)
        return row

    # Correctness once, untimed: a method that delivers wrong data is an error, not a number.
    got = step(batch if rank == 0 else None, rank)
    bad, aliases, expands = (None, True, None) if rank == 0 else check_received(
        got, cfg["profile"], cfg["micro_batches"], cfg["seed"])
    del got
    found = [None] * world
    dist.all_gather_object(found, (bad, aliases, expands))
    errors = [f"rank {r}: {b}" for r, (b, _, _) in enumerate(found) if b]
    row["aliases_preserved"] = all(a for r, (_, a, _) in enumerate(found) if r)
    kept = [e for r, (_, _, e) in enumerate(found) if r and e is not None]
    row["expand_preserved"] = all(kept) if kept else None
    if errors:
        row.update(status="error", reason="wrong data on followers: " + "; ".join(errors))
        return row

    times = []
    base = mem.start()
    for i in range(cfg["warmup"] + cfg["repeats"]):
        dist.barrier()
        t0 = time.perf_counter()
        got = step(batch if rank == 0 else None, rank)
        elapsed = time.perf_counter() - t0
        mem.sample()
        # A trainer drops the previous batch before the next arrives. TensorDict's rebuilt
        # batches sit in reference cycles, which only the cyclic GC frees; collect here, outside
        # the timed region, so each step's peak holds one batch and not every earlier one.
        del got
        gc.collect()
        slowest = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # outside the timed region
        if i >= cfg["warmup"]:
            times.append(slowest.item() * 1e3)
    extra = torch.tensor([mem.peak() - base, int(mem.exact)], dtype=torch.int64)
    extras = [torch.zeros_like(extra) for _ in range(world)]
    dist.all_gather(extras, extra)

    ms = statistics.median(times)
    payload = cfg["payload_bytes"]
    row.update(
        status="ok", reason=None,
        ms_median=ms, ms_min=min(times), ms_max=max(times), ms_repeats=times,
        gib_per_s=payload / 2**30 / (ms / 1e3) if ms > 0 else None,
        leader_extra_bytes=int(extras[0][0]),
        follower_extra_bytes=max(int(e[0]) for e in extras[1:]),
        rss_peak_exact=all(bool(e[1]) for e in extras),
    )
    return row


def worker_main(cfg):
    """One rank: init the group, build the batch on the root, run each method, tear down.
    The root appends one JSON line per method to cfg["rows_path"] as soon as it has it, so a
    later crash or timeout still leaves the finished methods behind."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(cfg["threads"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=cfg["pg_timeout"]))
    try:
        batch = make_batch(cfg["profile"], cfg["micro_batches"], cfg["seed"]) if rank == 0 else None
        size = torch.tensor([payload_bytes(batch) if rank == 0 else 0], dtype=torch.int64)
        dist.broadcast(size, src=0)
        cfg = dict(cfg, payload_bytes=int(size.item()))
        mem = PeakRss()
        for method in cfg["methods"]:
            row = run_method(method, batch, rank, world, cfg, mem)
            if rank == 0:
                row.update(profile=cfg["profile"], micro_batches=cfg["micro_batches"],
                           world_size=world, payload_bytes=cfg["payload_bytes"])
                with open(cfg["rows_path"], "a") as f:
                    f.write(json.dumps(row) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------------------------
# The parent: one cell at a time, every rank a child process, all of it bounded in time.
# --------------------------------------------------------------------------------------------

def job_store():
    """The cell's store, served from here on a port the kernel picks and open until the ranks are
    done, so no other job can take the port; the ranks connect to it as clients (torchrun's
    agent-store convention, TORCHELASTIC_USE_AGENT_STORE)."""
    import torch.distributed as dist
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _last_line(path) -> str:
    """The last non-empty line a rank printed, torch's "[rankN]:" prefix removed."""
    try:
        with open(path, errors="replace") as f:
            lines = [line.strip() for line in f.read()[-20000:].splitlines() if line.strip()]
    except OSError:
        return "(no log)"
    if not lines:
        return "(no output)"
    last = lines[-1]
    return last.split("]:", 1)[1].strip() if last.startswith("[rank") and "]:" in last else last


def estimated_payload(profile, micro_batches) -> int:
    """payload_bytes of a batch, from the shapes alone (the int32 cu_seq_lens left out)."""
    shape = PROFILES[profile]
    ids = 3 * shape.pack_length * 8  # input_ids, shifted_labels, one position_ids storage
    row = 3 * 448 * 448 * 4 if shape.tiles else 1536 * 4
    return micro_batches * (ids + shape.media_rows * row)


# Resident bytes per rank of one method, in payloads P, as measured on this benchmark: pickle
# holds the received bytes, a bytes copy and the unpickled storages on a follower (about 4P)
# and the pickled buffer plus its copy on the leader (2P over the batch); the other two hold
# the batch once, plus one reference micro-batch on a follower while it is checked.
_LEADER_P = {"pickle": 3.2, "accelerate": 1.2, "tensordict": 2.2, "spbcast-py": 1.2}
_FOLLOWER_P = {"pickle": 4.2, "accelerate": 2.2, "tensordict": 2.2, "spbcast-py": 2.2}
_RANK_BASE_BYTES = 400 << 20  # an idle rank: Python, torch, Gloo


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_skips(args, profile, micro_batches, world) -> dict:
    """Methods whose cell would not fit in memory, with the reason. An OOM kill on a shared
    machine takes out whoever is unlucky, so such a method is skipped rather than tried."""
    if args.mem_limit_gib == 0:
        return {}
    limit = args.mem_limit_gib * 2**30 if args.mem_limit_gib > 0 else 0.85 * mem_available()
    payload = estimated_payload(profile, micro_batches)
    skips = {}
    for method in args.methods:
        need = world * _RANK_BASE_BYTES + payload * (
            _LEADER_P[method] + (world - 1) * _FOLLOWER_P[method])
        if need > limit:
            skips[method] = (f"estimated {need / 2**30:.1f} GiB for {world} ranks exceeds the "
                             f"memory limit of {limit / 2**30:.1f} GiB (--mem-limit-gib)")
    return skips


def run_cell(args, profile, micro_batches, world) -> list[dict]:
    """Run one cell; always returns one row per requested method."""
    with tempfile.TemporaryDirectory(prefix="python_peers_") as tmp:
        rows_path = os.path.join(tmp, "rows.jsonl")
        cfg = {
            "profile": profile, "micro_batches": micro_batches, "methods": args.methods,
            "repeats": args.repeats, "warmup": args.warmup, "seed": args.seed,
            "pg_timeout": args.pg_timeout, "threads": args.threads, "rows_path": rows_path,
            "skip": memory_skips(args, profile, micro_batches, world),
        }
        store = job_store()
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port),
                   TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                   WORLD_SIZE=str(world), GLOO_SOCKET_IFNAME="lo",
                   OMP_NUM_THREADS=str(args.threads))
        procs, logs = [], []
        for rank in range(world):
            log = os.path.join(tmp, f"rank{rank}.log")
            with open(log, "w") as out:
                # A new session per rank, so a timeout kills exactly the ranks started here.
                procs.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), "--_worker", json.dumps(cfg)],
                    env=dict(env, RANK=str(rank)), stdout=out, stderr=subprocess.STDOUT,
                    start_new_session=True))
            logs.append(log)

        deadline = time.monotonic() + args.cell_timeout
        timed_out = False
        while any(p.poll() is None for p in procs):
            if any(p.returncode not in (None, 0) for p in procs):
                break  # the others would only wait for that rank until the group timeout
            if time.monotonic() > deadline:
                timed_out = True
                break
            time.sleep(0.1)
        killed = set()
        for rank, p in enumerate(procs):
            if p.poll() is None:
                killed.add(rank)
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        # Name every rank that failed on its own, with the last line it printed (usually the
        # exception); the one that crashed first is among them, its peers' "connection
        # closed" errors beside it.
        failures = [f"rank {r} exited with {p.returncode}: {_last_line(logs[r])}"
                    for r, p in enumerate(procs) if r not in killed and p.returncode != 0]
        if timed_out:
            failures.insert(0, f"cell timed out after {args.cell_timeout:g} s; killed ranks {sorted(killed)}")
        failure = "; ".join(failures) or None

        rows = []
        if os.path.exists(rows_path):
            with open(rows_path) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        done = {r["method"] for r in rows}
        payload = rows[0]["payload_bytes"] if rows else None
        for method in args.methods:
            if method not in done:
                rows.append({"profile": profile, "micro_batches": micro_batches,
                             "world_size": world, "method": method, "status": "error",
                             "reason": failure or "no result from the root",
                             "payload_bytes": payload, "repeats": args.repeats,
                             "warmup": args.warmup})
        order = {m: i for i, m in enumerate(args.methods)}
        return [full_row(r) for r in sorted(rows, key=lambda r: order[r["method"]])]


# Every row has every key, in this order; what a skipped or failed method did not measure is null.
ROW_KEYS = (
    "profile", "micro_batches", "world_size", "method", "status", "reason",
    "payload_bytes",          # distinct storage bytes the batch references (aliases once)
    "wire_bytes",             # bytes the root hands to the collectives (pickles + tensors)
    "ms_median", "ms_min", "ms_max", "gib_per_s",  # step = max over ranks; GiB/s of payload
    "collectives",            # c10d collectives per step
    "follower_extra_bytes",   # max over followers of peak RSS minus RSS before the steps
    "leader_extra_bytes",     # the same on the root
    "repeats", "warmup", "ms_repeats",
    "aliases_preserved",      # cu_seq_lens_k is cu_seq_lens_q on every follower
    "expand_preserved",       # 3-D rope position_ids still stride 0 (null: not a rope_3d profile)
    "rss_peak_exact",         # peaks from a reset VmHWM (false: after-step samples only)
)


def full_row(row: dict) -> dict:
    return {key: row.get(key) for key in ROW_KEYS}


def machine_info() -> dict:
    info = {"cpu_model": None, "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)), "mem_total_bytes": None,
            "kernel": platform.release(), "platform": platform.platform(),
            "loadavg_at_start": os.getloadavg()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu_model"] = line.split(":", 1)[1].strip()
                    break
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    info["mem_total_bytes"] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return info


def _csv(kind, choices=None):
    def parse(text):
        items = [kind(x) for x in text.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError("empty list")
        if choices is not None:
            unknown = [x for x in items if x not in choices]
            if unknown:
                raise argparse.ArgumentTypeError(f"unknown {unknown}; choose from {','.join(choices)}")
        return items
    return parse


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description="Time the Python peers of spbcast (broadcast_object_list, accelerate-style "
                    "dispatch, TensorDict.broadcast) on loopback Gloo with realistic batches.")
    p.add_argument("--profiles", type=_csv(str, list(PROFILES)), default=list(PROFILES),
                   help="comma-separated: " + ",".join(PROFILES) + " (default: all)")
    p.add_argument("--micro-batches", type=_csv(int), default=[1, 4],
                   help="comma-separated micro-batch counts (default: 1,4)")
    p.add_argument("--world-sizes", type=_csv(int), default=[2, 4, 8],
                   help="comma-separated group sizes, each >= 2 (default: 2,4,8)")
    p.add_argument("--methods", type=_csv(str, list(ALL_METHODS)), default=list(ALL_METHODS),
                   help="comma-separated: " + ",".join(ALL_METHODS) + " (default: all)")
    p.add_argument("--repeats", type=int, default=7, help="timed steps per method (default: 7)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per method (default: 2)")
    p.add_argument("--seed", type=int, default=0, help="batch generator seed (default: 0)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads per rank (default: 1; ranks share the cores)")
    p.add_argument("--pg-timeout", type=float, default=300.0,
                   help="seconds before a Gloo collective or the rendezvous gives up (default: 300)")
    p.add_argument("--cell-timeout", type=float, default=1800.0,
                   help="seconds before the parent kills a cell's ranks (default: 1800)")
    p.add_argument("--mem-limit-gib", type=float, default=-1.0,
                   help="skip a method whose cell is estimated to need more memory than this "
                        "(default: 85%% of MemAvailable when the cell starts; 0 disables)")
    p.add_argument("--json", default="python_peers.json", help="output file (default: %(default)s)")
    p.add_argument("--_worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._worker is None:
        if min(args.world_sizes) < 2:
            p.error("--world-sizes: every size must be at least 2 (a root and a follower)")
        if min(args.micro_batches) < 1 or args.repeats < 1 or args.warmup < 0:
            p.error("--micro-batches and --repeats must be >= 1, --warmup >= 0")
    return args


def write_json(path, doc):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)  # a reader never sees half a file


def main(argv=None):
    args = parse_args(argv)
    if args._worker is not None:
        worker_main(json.loads(args._worker))
        return

    import torch

    try:
        import tensordict
        td_version = tensordict.__version__
    except Exception:  # noqa: BLE001
        td_version = None
    doc = {
        "machine": machine_info(),
        "torch": torch.__version__,
        "tensordict": td_version,
        "python": platform.python_version(),
        "config": {k: v for k, v in vars(args).items() if k != "_worker"},
        "results": [],
    }
    cells = [(p, m, w) for p in args.profiles for m in args.micro_batches for w in args.world_sizes]
    for n, (profile, micro_batches, world) in enumerate(cells, 1):
        t0 = time.monotonic()
        rows = run_cell(args, profile, micro_batches, world)
        doc["results"].extend(rows)
        write_json(args.json, doc)
        summary = ", ".join(
            f"{r['method']} {r['ms_median']:.1f} ms" if r["status"] == "ok" else f"{r['method']} {r['status']}"
            for r in rows)
        print(f"[{n}/{len(cells)}] {profile} mb={micro_batches} ws={world}: {summary} "
              f"({time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
        for r in rows:
            if r["status"] != "ok":
                print(f"    {r['method']}: {r['reason']}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
