"""Stats: what the loop's broadcasts did on this rank (LeaderLoader.stats()), and the one-line
summary of them logged every ``log_every`` steps and at the end of the data."""

import dataclasses
import logging

import torch

from .._wire import torch_nested
from .._wire.kind_tensordict import from_tensordict


class Stats:
    """This rank's counters. ``loads_here``: this rank runs the loader (the leader, or every rank
    without dedup), so a step's loader seconds are its own, not the leader's; the summary line
    speaks as the SP leader's (``is_leader``) or as a follower's."""

    def __init__(self, where, is_leader, loads_here, log_every, log):
        self._where, self._is_leader, self._loads_here = where, is_leader, loads_here
        self.log_every = log_every
        self._log = log if log is not None else logging.getLogger("spbcast").info
        self.counts = {"steps": 0, "bytes": 0, "loader_seconds": 0.0, "broadcast_seconds": 0.0,
                       "leader_loader_seconds": 0.0, "wait_seconds": 0.0, "prefetch_hits": 0}

    def count_prefetch_hit(self, hit):
        self.counts["prefetch_hits"] += hit

    def count_step(self, received, batch, seconds, waited, summary):
        """One step as every rank takes it (``received``: its envelope); ``summary()`` gives the
        line to log when one is due."""
        counts = self.counts
        counts["broadcast_seconds"] += seconds
        counts["wait_seconds"] += waited
        if received["done"]:
            if self.log_every:
                self._log(summary())
            return
        counts["steps"] += 1
        counts["bytes"] += _tensor_bytes(batch)
        if self._loads_here:
            counts["loader_seconds"] += received["seconds"]
        else:
            counts["leader_loader_seconds"] += received["seconds"]
        if self.log_every and counts["steps"] % self.log_every == 0:
            self._log(summary())

    def summary(self, s):
        """The line for ``s``, a stats() dict."""
        line = (self._where + f": {s['steps']} steps on the {s['path']} path, "
                f"{s['bytes'] / (1 << 20):.1f} MiB")
        if s["prefetch"]:
            line += f", prefetch {s['prefetch']} ({s['prefetch_hits']} steps' batches were here)"
        else:
            line += f", no prefetch ({s['prefetch_reason']})"
        line += f"; the trainer waited {s['wait_seconds']:.2f} s"
        if self._is_leader:
            return line + (f"; {s['loader_seconds']:.2f} s in the loader, "
                           f"{s['broadcast_seconds']:.2f} s broadcasting")
        return line + (f"; {s['broadcast_seconds']:.2f} s in the broadcasts, "
                       f"{s['leader_loader_seconds']:.2f} s of it the leader's loader")


def _tensor_bytes(value, seen=None):
    """The bytes of the distinct tensor storages in a batch (as spbcast sends each once)."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        if torch_nested.is_jagged(value):  # no storage of its own: its parts' storages
            p = torch_nested.parts(value)
            return sum(_tensor_bytes(t, seen) for t in (p.values, p.offsets, p.lengths) if t is not None)
        storage = value.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        return storage.nbytes()
    if isinstance(value, dict):
        return sum(_tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v, seen) for v in value)
    if from_tensordict(type(value)):
        values = getattr(value, "values", None)
        return sum(_tensor_bytes(v, seen) for v in values()) if callable(values) else 0
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return sum(_tensor_bytes(getattr(value, f.name), seen) for f in dataclasses.fields(value))
    return 0
