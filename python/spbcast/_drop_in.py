"""What the trainer drop-ins (spbcast.accelerate, spbcast.swift) share: the options of enable()
and the Gloo groups of ranks that a host trainer gives one data index."""

import datetime

import torch.distributed as dist

from .errors import Error

# LeaderLoader's options that enable() passes on; the rest are fixed by the host trainer's loop
# (one pass per iter(), the epochs driven by the trainer).
OPTIONS = ("timeout", "root_wait", "transport", "relay_chunk_bytes",
           "leader_allocates_in_shared_memory", "prefetch", "log_every", "log")


def check_options(where, options):
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise Error(where + f": enable() got {', '.join(map(repr, unknown))}; the options are "
                    f"LeaderLoader's {', '.join(OPTIONS)}", "invalid_argument")


_GROUPS = {}  # (world, size) -> the Gloo group of each data index, made once per process


def data_index_groups(world, size, timeout):
    """One Gloo group per data index (ranks index * size ...), made by every rank in the same
    order: dist.new_group is a collective of the whole default group."""
    if (world, size) not in _GROUPS:
        _GROUPS[world, size] = [
            dist.new_group(list(range(start, min(start + size, world))), backend="gloo",
                           timeout=datetime.timedelta(seconds=timeout))
            for start in range(0, world, size)]
    return _GROUPS[world, size]
