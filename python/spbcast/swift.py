"""ms-swift: only the leader of each sequence-parallel group runs the SP train loader; the
group's other ranks get its batches.

    spbcast.swift.enable()      # every rank, before the trainer builds its train loader
    swift sft ... --external_plugins "$(python -m spbcast.swift)"     # the CLI

ms-swift's SP groups are blocks of ``sequence_parallel_size`` consecutive ranks (its
``('data', ['ring'], 'sequence')`` mesh), and its trainers' ``get_sp_dataloader`` gives every
rank of a block the same ``SequenceParallelSampler`` indices and worker seeds: each rank of the
block encodes the same samples (images and videos decoded by the template) and the split happens
later, in the model's forward pre-hook. After ``enable``, every train loader ms-swift's
``DataLoaderMixin.get_train_dataloader`` builds under SP (the resume path's, with
``skip_batches``, too) stays ms-swift's ``DataLoaderShard`` on every rank - its ``len()``,
``set_epoch``, samplers, device placement - and only its iteration changes: the block's leader
(lowest rank) iterates its own through a ``LeaderLoader`` and every rank of the block gets the
leader's batch over a Gloo group of the block's ranks. Each follower's default CPU generator
advances as its own loader would have advanced it.

Refused on every rank, before any collective: streaming SP (an iterable dataset, which ms-swift
gives a ``SequenceParallelDispatcher``), a mesh whose data blocks are not consecutive ranks, and
Megatron-SWIFT (``enable`` with ``swift.megatron`` loaded: its loaders come from Megatron's data
path). Loaders ms-swift builds elsewhere (evaluation, the rollout trainers without
``DataLoaderMixin``) are left as they are. This module imports ms-swift only when ``enable`` runs;
``import spbcast`` does not import it.
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.utils.data

from ._broadcast import _group_timeout
from ._drop_in import check_options, data_index_groups
from .errors import Error
from .loader import LeaderLoader

__all__ = ["enable", "stats", "plugin_path"]

_ATTRIBUTE = "_spbcast_leader_loader"  # on a DataLoaderShard whose iteration is shared
_INSTALLED = {}  # what enable() replaced, once per process: the originals and the options


def _where():
    return f"spbcast: rank {dist.get_rank() if dist.is_initialized() else 0} (spbcast.swift)"


def plugin_path():
    """The file to give ``swift sft``'s ``--external_plugins``: it calls ``enable()`` on every
    rank when ms-swift imports it (``python -m spbcast.swift`` prints this path)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugins", "spbcast_swift_plugin.py")


def enable(**options):
    """From now on (process-wide), every SP train loader an ms-swift trainer builds is iterated
    only by the leader of each SP group; the others receive its batches. ``options``:
    LeaderLoader's ``timeout``, ``root_wait``, ``transport``, ``relay_chunk_bytes``,
    ``leader_allocates_in_shared_memory``, ``prefetch``, ``log_every``, ``log``. Call it on every
    rank, before the trainer builds its train loader (``trainer.train()``); calling it again
    replaces the options. Loaders built before it are left as they are."""
    check_options(_where(), options)
    if "swift.megatron" in sys.modules:
        # Megatron-SWIFT parses its arguments (and imports the --external_plugins files) with
        # swift.megatron loaded, on every rank alike. Its loaders come from Megatron's data path,
        # grouped by Megatron's parallel state, not from DataLoaderMixin.
        raise Error(_where() + ": Megatron-SWIFT (megatron sft / pt / rlhf) builds its loaders "
                    "through Megatron's data path, which spbcast.swift does not share; remove the "
                    "spbcast plugin (--external_plugins) or the enable() call from a Megatron-SWIFT run",
                    "invalid_argument")
    from swift.dataloader import DataLoaderShard
    from swift.trainers.mixin import DataLoaderMixin

    _INSTALLED["options"] = dict(options)
    if "get_train_dataloader" in _INSTALLED:
        return
    get_train_dataloader = _INSTALLED["get_train_dataloader"] = DataLoaderMixin.get_train_dataloader
    shard_iter = _INSTALLED["shard_iter"] = DataLoaderShard.__iter__

    def shared_get_train_dataloader(self, *args, **kwargs):
        loader = get_train_dataloader(self, *args, **kwargs)
        if self.template.sequence_parallel_size > 1:
            _share(loader, _INSTALLED["options"])
        return loader

    def __iter__(self):
        leader_loader = self.__dict__.get(_ATTRIBUTE)
        if leader_loader is None:
            return shard_iter(self)
        return _shared_pass(self, leader_loader)

    # The trainer reaches both through its class (DataLoaderMixin's method, the resume path's
    # skip_first_batches calls self.get_train_dataloader); every other DataLoaderShard is
    # iterated as before.
    DataLoaderMixin.get_train_dataloader = shared_get_train_dataloader
    DataLoaderShard.__iter__ = __iter__


def stats(loader):
    """``LeaderLoader.stats()`` of a train loader built after ``enable`` (on every rank: the
    path, steps, bytes, prefetch depth and hits, the waits), or None where it is ms-swift's own."""
    leader_loader = getattr(loader, "__dict__", {}).get(_ATTRIBUTE)
    return None if leader_loader is None else leader_loader.stats()


def _shared_pass(shard, leader_loader):
    # As DataLoaderShard.__iter__: a generator, so nothing runs (not even the leader's iterator,
    # which draws the pass's base seed) before the trainer's first next(); then each batch as
    # ms-swift places it.
    from swift.utils import to_device

    for batch in leader_loader:
        yield to_device(batch, shard.device) if shard.device else batch


def _share(loader, options):
    # Decided alike on every rank (the same mesh, dataset and trainer arguments), before the
    # first collective of spbcast: a refusal leaves no rank waiting.
    from swift.dataloader import DataLoaderShard
    from swift.sequence_parallel import SequenceParallelDispatcher, sequence_parallel

    if isinstance(loader, SequenceParallelDispatcher):
        raise Error(_where() + ": streaming sequence parallelism (an iterable train dataset: "
                    "ms-swift's SequenceParallelDispatcher, where ranks 0..sp-1 each read the whole "
                    "stream) is not one spbcast.swift shares; give the trainer a map-style dataset "
                    "(no --streaming) or do not call spbcast.swift.enable", "invalid_argument")
    if type(loader) is not DataLoaderShard:
        raise Error(_where() + f": ms-swift built a {type(loader).__name__} as the SP train loader, "
                    "not the DataLoaderShard of get_sp_dataloader that spbcast.swift shares; this "
                    "ms-swift is not one spbcast.swift knows: do not call spbcast.swift.enable",
                    "invalid_argument")
    if _ATTRIBUTE in loader.__dict__:
        return
    if not dist.is_initialized():
        raise Error(_where() + ": sequence parallelism without torch.distributed initialized",
                    "invalid_argument")
    size, world, rank = sequence_parallel.world_size, dist.get_world_size(), dist.get_rank()
    if (world % size or sequence_parallel.dp_rank != rank // size
            or sequence_parallel.dp_world_size != world // size):
        raise Error(_where() + f": ms-swift's data rank {sequence_parallel.dp_rank} of "
                    f"{sequence_parallel.dp_world_size} (sequence_parallel_size {size}, world "
                    f"{world}) is not this rank's block of consecutive ranks; spbcast.swift groups "
                    "the ranks as ms-swift's device mesh does: run one process per rank of the "
                    "default group, or do not call spbcast.swift.enable", "invalid_argument")
    group = data_index_groups(world, size, _group_timeout(None))[rank // size]
    loader.__dict__[_ATTRIBUTE] = _SwiftLeaderLoader(loader, group, **options)


class _SwiftLeaderLoader(LeaderLoader):
    """The LeaderLoader of one SP train loader: on the leader it iterates the loader as torch's
    DataLoader (ms-swift's device placement follows on every rank, after the broadcast)."""

    def __init__(self, shard, group, **options):
        self._shard = shard
        # The trainer drives the passes: one pass per iter(), set_epoch on the loader itself.
        super().__init__(lambda: _TorchPasses(shard), group, sp_media_dedup=True, set_epoch=None,
                         **options)

    def prefetch_policy(self, requested):
        # With workers, the fetch runs in them except the sampler, which runs here: ms-swift's
        # SequenceParallelSampler (under accelerate's SkipBatchSampler on resume) draws from a
        # generator of its own, nothing from the default CPU generator after the pass's iterator
        # was made on the trainer's thread, as in BASE.
        if requested is not None:
            return requested, f"prefetch={requested}", None
        from swift.sequence_parallel import SequenceParallelSampler

        shard = self._shard
        if shard.num_workers == 0:
            return 0, ("num_workers=0: the template encodes in this process, where it or the "
                       "collator may draw from the default CPU generator (pass prefetch=1 to "
                       "enable() if they do not)"), None
        sampler = shard.sampler
        while hasattr(sampler, "batch_sampler"):  # accelerate's SkipBatchSampler (resume)
            sampler = sampler.batch_sampler
        if type(sampler) is not SequenceParallelSampler or type(shard.batch_sampler) is not torch.utils.data.BatchSampler:
            return 0, (f"the sampler {type(sampler).__name__} is not ms-swift's "
                       "SequenceParallelSampler (pass prefetch=1 to enable() if it draws nothing "
                       "from the default CPU generator)"), None
        return 1, f"ms-swift's SP loader with {shard.num_workers} workers", None


class _TorchPasses:
    """What the leader's LeaderLoader iterates: each pass is torch's DataLoader iteration of the
    DataLoaderShard (its samplers, workers and collator, as ms-swift built them)."""

    def __init__(self, shard):
        self.shard = shard

    def __iter__(self):
        return torch.utils.data.DataLoader.__iter__(self.shard)

    def __len__(self):
        return len(self.shard)


if __name__ == "__main__":
    print(plugin_path())
