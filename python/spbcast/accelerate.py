"""Hugging Face accelerate (and transformers' Trainer): only the leader of each group of ranks that
accelerate gives the same data index loads; the others get its batches.

    spbcast.accelerate.enable(accelerator)              # before accelerator.prepare(...)
    spbcast.accelerate.enable(trainer.accelerator)      # the Trainer (TRL's too): before train()

With a device mesh whose ``tp`` / ``cp`` dimensions make several ranks share a data index
(accelerate's ``prepare_data_loader`` divides ``process_index`` by their product), every rank of
such a group runs its own DataLoader over the same samples. After ``enable``, every DataLoader the
accelerator prepares keeps accelerate's ``DataLoaderShard`` on every rank - its rng
synchronization (a world collective), ``begin``/``end`` and the gradient state one batch ahead,
``set_epoch``, device placement, ``len()`` - and only the iteration of its base DataLoader changes:
the group's leader (lowest rank) iterates its own through a ``LeaderLoader``, and every rank of
the group gets the leader's batch over a Gloo group of those ranks that spbcast makes. So the ranks
of a group hold the same batch by construction, and each follower's default CPU generator advances
as its own DataLoader would have advanced it. A loader accelerate's ``skip_first_batches`` makes
from such a loader (the Trainer's resume) is iterated the same way.

Without a mesh, or where each rank has its own data index, the loader is accelerate's own,
untouched. This module imports accelerate; ``import spbcast`` does not.
"""

import math
import weakref

import torch
import torch.distributed as dist
import torch.utils.data
from accelerate.data_loader import DataLoaderDispatcher, DataLoaderShard, SeedableRandomSampler, SkipBatchSampler
from accelerate.utils import DistributedType

from ._broadcast import _group_timeout
from ._drop_in import check_options, data_index_groups
from ._loader.generators import REPLAYABLE_SAMPLERS
from .errors import Error
from .loader import LeaderLoader

__all__ = ["enable", "stats"]


def _where():
    return f"spbcast: rank {dist.get_rank() if dist.is_initialized() else 0} (spbcast.accelerate)"


def enable(accelerator, **options):
    """From now on, every DataLoader ``accelerator`` prepares (``prepare``,
    ``prepare_data_loader``) is iterated only by the leader of each group of ranks that accelerate
    gives the same data index; the batch reaches the group's other ranks over a Gloo group of its
    ranks. ``options``: LeaderLoader's ``timeout``, ``root_wait``, ``transport``,
    ``relay_chunk_bytes``, ``leader_allocates_in_shared_memory``, ``prefetch``, ``log_every``,
    ``log``. Call it on every rank. Loaders prepared before it are left as they are."""
    check_options(_where(), options)
    if accelerator.distributed_type == DistributedType.MEGATRON_LM:
        raise Error(_where() + ": the Megatron-LM plugin prepares its data loaders itself "
                    "(megatron_lm_prepare_data_loader), not through prepare_data_loader; spbcast "
                    "cannot share them: do not call enable() for it", "invalid_argument")
    _hook_skipped_loaders()
    prepare = getattr(accelerator, "_spbcast_prepare_data_loader", None)
    if prepare is None:  # the Accelerator's own method, kept once however often enable() runs
        prepare = accelerator._spbcast_prepare_data_loader = accelerator.prepare_data_loader

    def prepare_data_loader(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        prepared = prepare(data_loader, device_placement=device_placement,
                           slice_fn_for_dispatch=slice_fn_for_dispatch)
        _share(accelerator, prepared, options)
        return prepared

    # An attribute of this accelerator only: Accelerator.prepare reaches it through
    # self.prepare_data_loader, and no other accelerator changes.
    accelerator.prepare_data_loader = prepare_data_loader


def stats(loader):
    """``LeaderLoader.stats()`` of a loader the accelerator prepared after ``enable`` (on every
    rank: the path, steps, bytes, prefetch depth and hits, the waits), or None where accelerate's
    loader is untouched (no shared data index)."""
    base = getattr(loader, "base_dataloader", None)
    return base.shared.loader.stats() if isinstance(base, _BroadcastBase) else None


def _shared_index_size(accelerator):
    """How many ranks accelerate gives each data index (1: each rank its own), with
    prepare_data_loader's own arithmetic: with a device mesh, the data index is
    process_index // (tp * cp) (DeepSpeed's mesh: // tp). An SP group of accelerate's (DeepSpeed
    ALST, which builds no mesh) gives each of its ranks a sample of its own: nothing to share."""
    # accelerate-internal, named here only: the mesh Accelerator.prepare_data_loader passes on.
    mesh = accelerator._prepare_device_mesh()
    if mesh is None:
        return 1
    names = tuple(mesh.mesh_dim_names or ())
    shared = ("tp",) if accelerator.distributed_type == DistributedType.DEEPSPEED else ("tp", "cp")
    return math.prod(mesh[name].size() for name in shared if name in names)


def _data_group(accelerator, size):
    """The Gloo group of the ranks accelerate gives this rank's data index (ranks index * size ...)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if (accelerator.process_index, accelerator.num_processes) != (rank, world):
        raise Error(_where() + f": accelerate's process {accelerator.process_index} of "
                    f"{accelerator.num_processes} is not this rank of the default process group "
                    f"({rank} of {world}); spbcast groups the ranks by the data index accelerate "
                    "computes from process_index: run one process per rank of the default group",
                    "invalid_argument")
    return data_index_groups(world, size, _group_timeout(None))[rank // size]


def _share(accelerator, prepared, options):
    # Decided alike on every rank, before spbcast's first collective: a refusal leaves none waiting.
    size = _shared_index_size(accelerator)
    if size == 1 or isinstance(getattr(prepared, "base_dataloader", None), _BroadcastBase):
        return  # each rank its own data index; or prepared (and shared) before
    if isinstance(prepared, DataLoaderDispatcher):
        raise Error(_where() + ": this DataLoader was prepared with dispatch_batches=True "
                    "(accelerate's default for an IterableDataset): its DataLoaderDispatcher loads on "
                    "process 0 for the whole job, which spbcast cannot split by TP/CP group; give the "
                    "Accelerator DataLoaderConfiguration(dispatch_batches=False) (the Trainer: "
                    "accelerator_config={\"dispatch_batches\": False}) so that each group's leader "
                    "loads, or do not call spbcast.accelerate.enable", "invalid_argument")
    if not isinstance(prepared, DataLoaderShard):
        raise Error(_where() + f": accelerate prepared a {type(prepared).__name__}, not the "
                    "DataLoaderShard spbcast shares; this accelerate is not one spbcast.accelerate "
                    "knows: do not call spbcast.accelerate.enable", "invalid_argument")
    group = _data_group(accelerator, size)
    _iterate_through(prepared, _SharedLoader(prepared.base_dataloader, group, options))


def _iterate_through(shard, shared):
    """From now on, iterating ``shard`` (a DataLoaderShard) iterates the group leader's broadcast."""
    shard.base_dataloader = _BroadcastBase(shard.base_dataloader, shared, getattr(shard, "dl_state_dict", None))


# The shared loaders by what accelerate's skip_first_batches keeps of them in the loader it makes:
# the batch sampler a SkipBatchSampler wraps, or, for an iterable dataset, the dataset.
_BY_ORIGIN = weakref.WeakValueDictionary()


def _origin(real):
    sampler = _index_sampler(real)
    return real.dataset if sampler is None else sampler


def _index_sampler(real):
    """The batch sampler a DataLoader iterates (None: an iterable dataset's)."""
    if isinstance(real.sampler, torch.utils.data.BatchSampler):  # prepare's sampler_is_batch_sampler
        return real.sampler
    return real.batch_sampler if not isinstance(real.dataset, torch.utils.data.IterableDataset) else None


def _shared_origin_of(real):
    """The _SharedLoader a skip_first_batches loader was made from, or None."""
    key = _index_sampler(real)
    while isinstance(key, SkipBatchSampler):
        key = key.batch_sampler
    if key is None:
        key = real.dataset
    shared = _BY_ORIGIN.get(id(key))
    return shared if shared is not None and shared.origin is key else None


_ACCELERATE_ITER = None


def _hook_skipped_loaders():
    """accelerate's skip_first_batches (the Trainer's resume path) builds a new DataLoaderShard
    over a new base DataLoader; the Trainer calls the function it imported, so the new loader is
    found when it is iterated: DataLoaderShard.__iter__ gives one made from a shared loader the
    shared loader's broadcast, then runs accelerate's own. Installed once per process; every
    other DataLoaderShard is iterated as before."""
    global _ACCELERATE_ITER
    if _ACCELERATE_ITER is not None:
        return
    _ACCELERATE_ITER = DataLoaderShard.__iter__

    def __iter__(self):
        if not isinstance(self.base_dataloader, _BroadcastBase):
            shared = _shared_origin_of(self.base_dataloader)
            if shared is not None:
                _iterate_through(self, shared)
        return _ACCELERATE_ITER(self)

    DataLoaderShard.__iter__ = __iter__


class _SharedLoader:
    """What the ranks of one data-index group share for one prepared DataLoader: the LeaderLoader
    (made on every rank of the group, at prepare) and, on the leader, the base DataLoader the
    current pass iterates (the prepared one, or one skip_first_batches made from it)."""

    def __init__(self, real, group, options):
        self.origin = _origin(real)
        # A StatefulDataLoader's state after each batch travels with it: DataLoaderShard reads
        # base_dataloader.state_dict() after every batch, on every rank.
        self.stateful = callable(getattr(real, "state_dict", None))
        self.source = _Source(real, self.stateful)
        self.loader = _AccelerateLeaderLoader(self.source, group, **options)
        _BY_ORIGIN[id(self.origin)] = self

    def iterate(self, base):
        """One pass of ``base`` (a _BroadcastBase), on every rank of the group: the leader's batches."""
        self.source.current = base.real
        for item in self.loader:
            if self.stateful:
                item, base.state = item
            yield item


class _Source:
    """The iterable the LeaderLoader iterates on the leader: the current pass's base DataLoader,
    each batch with the loader's state after it where the loader keeps one."""

    def __init__(self, real, stateful):
        self.current, self.stateful = real, stateful

    def __iter__(self):
        real = self.current
        batches = iter(real)
        if not self.stateful:
            return batches
        return ((batch, real.state_dict()) for batch in batches)


class _AccelerateLeaderLoader(LeaderLoader):
    def __init__(self, source, group, **options):
        self._source = source
        # DataLoaderShard drives the passes: one pass per iter(), its own set_epoch on every rank.
        super().__init__(lambda: source, group, sp_media_dedup=True, set_epoch=None, **options)

    def prefetch_policy(self, requested):
        # The fetch of a DataLoader with workers runs in them, except its batch sampler, which runs
        # here: accelerate's BatchSamplerShard and SkipBatchSampler around torch's samplers (their
        # own generators, which prepare_data_loader gives them) draw nothing from the default CPU
        # generator after the pass's iterator was made - on the trainer's thread, as in BASE.
        if requested is not None:
            return requested, f"prefetch={requested}", None
        real = self._source.current
        if not isinstance(real, torch.utils.data.DataLoader) or real.num_workers == 0:
            return 0, ("num_workers=0: the fetch runs in this process, where the dataset or the "
                       "collate function may draw from the default CPU generator (pass prefetch=1 "
                       "to enable() if they do not)"), None
        sampler = _innermost_sampler(real)
        if not (isinstance(real.dataset, torch.utils.data.IterableDataset)
                or type(sampler) in REPLAYABLE_SAMPLERS + (SeedableRandomSampler,)):
            return 0, (f"the sampler {type(sampler).__name__} is not one of torch's or accelerate's, "
                       "and it runs in this process at every fetch (pass prefetch=1 to enable() if "
                       "it draws nothing from the default CPU generator)"), None
        return 1, f"accelerate's DataLoader with {real.num_workers} workers", None


def _innermost_sampler(real):
    """The sampler under accelerate's and torch's batch samplers (BatchSamplerShard, BatchSampler)."""
    sampler = _index_sampler(real)
    while True:
        if hasattr(sampler, "batch_sampler"):  # BatchSamplerShard, SkipBatchSampler
            sampler = sampler.batch_sampler
        elif type(sampler) is torch.utils.data.BatchSampler:
            sampler = sampler.sampler
        else:
            return sampler


def _is_stateful_dataloader(loader):
    return type(loader).__module__.startswith("torchdata.stateful_dataloader")


class _BroadcastBase:
    """Stands in for a DataLoaderShard's base DataLoader: iterating it is the group leader's pass,
    broadcast; everything else (len, the samplers, the dataset, its class for isinstance) is this
    rank's own DataLoader, which a follower never iterates."""

    def __init__(self, real, shared, state):
        self.real, self.shared = real, shared
        # A stateful loader's state: as accelerate took it when it built the loader, as loaded, or
        # the leader's after the last batch this rank received - never read from a follower's own.
        self.state = state
        if not shared.loader.is_leader and _is_stateful_dataloader(real):
            # accelerate's DataLoaderAdapter took the loader's state_dict() when it built it, and
            # torchdata's StatefulDataLoader starts an iterator for that (its workers, their first
            # prefetched samples), which the first iter() would reuse. A follower never iterates:
            # load_state_dict({}) drops that iterator, and its workers end.
            real.load_state_dict({})

    def __iter__(self):
        return self.shared.iterate(self)

    def __len__(self):
        return len(self.real)

    def __getattr__(self, name):
        if name == "real":  # not set yet (copy, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.real, name)

    @property
    def __class__(self):
        return self.real.__class__

    @property
    def state_dict(self):
        # Only where the real loader has one: hasattr is how DataLoaderShard asks, after every batch.
        self.real.state_dict  # noqa: B018 - raises AttributeError where it has none
        return lambda: self.state

    def load_state_dict(self, state):
        self.real.load_state_dict(state)  # the leader's next pass starts from it
        self.state = state
