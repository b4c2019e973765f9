"""Megatron-Energon's savable data loader, loaded once per group of ranks that share a data index.

    from spbcast.energon import get_savable_loader     # Energon's, plus group=
    train_loader = get_savable_loader(train_ds, group=tp_group)

``group`` holds the ranks that read the same data (tensor parallel x context parallel, and
pipeline parallel where wanted); its leader - its lowest global rank - iterates Energon's own
``SavableDataLoader`` and its worker processes, and every rank of the group receives each batch
from it, bit for bit, as the same Energon batch class. ``group=None`` (or a group of one rank)
returns Energon's loader as shipped.

Checkpoints stay Energon's: the leader's ``save_state_rank()`` is its ``SavableDataLoader``'s state,
followers' is None, and ``restore_state_rank(state)`` is called on every rank of the group, so a
run may switch between this loader and Energon's own across a checkpoint. A state the leader
cannot restore is an error on every rank of the group.

This module imports megatron.energon; ``import spbcast`` does not import it.
"""

import dataclasses
from pathlib import PurePosixPath

import torch
import torch.distributed as dist

import megatron.energon
from megatron.energon import Batch, SavableDataLoader, SourceInfo
from megatron.energon.epathlib import EPath
from megatron.energon.flavors.base_dataset import Sample

from ._loader.generators import persistent_iterator, shut_down_workers
from ._wire import allow_classes
from .errors import Error
from .loader import LeaderLoader

__all__ = ["get_savable_loader", "EnergonLeaderLoader"]


def get_savable_loader(dataset, *, group, prefetch=None, root_wait=None, timeout=None, **kwargs):
    """Energon's ``get_savable_loader(dataset, **kwargs)``, loaded on ``group``'s leader only.

    dataset: what Energon's ``get_train_dataset`` / ``get_val_dataset`` returned, built on every
        rank as without spbcast (building it reads indexes and decodes nothing); followers may
        pass None instead, and then build nothing.
    group: the process group of the ranks that share a data index (their datasets have one
        ``WorkerConfig.rank``), with a CPU backend (Gloo). None, or a group of one rank: Energon's
        own loader, unchanged.
    prefetch: batches the leader fetches and sends ahead while the trainer runs its step. None:
        1 where Energon's worker processes run the task encoder; 0 with ``num_workers=0``, where
        only 0 is allowed (the task encoder then runs in the trainer's process, where it may draw
        from the default CPU generator, and each iter() is a new iterator of Energon's, which
        would drop a batch fetched ahead).
    root_wait, timeout: as ``spbcast.LeaderLoader``'s.
    kwargs: Energon's ``get_savable_loader`` arguments (checkpoint_every_sec, prefetch_factor,
        ...), used on the leader.
    """
    if group is None:
        return megatron.energon.get_savable_loader(dataset, **kwargs)
    if dist.get_rank(group) < 0:  # before any collective: the group's ranks would wait for it
        raise Error(f"spbcast: rank {dist.get_rank()} (spbcast.energon): get_savable_loader: this "
                    "rank is not in the group it was given; pass each rank the group of the ranks "
                    "that read its data (its own tensor x context parallel ranks)", "invalid_argument")
    if dist.get_world_size(group) == 1:
        return megatron.energon.get_savable_loader(dataset, **kwargs)
    allow_classes(*_energon_batch_classes(), _EPathState)
    return EnergonLeaderLoader(dataset, group, prefetch=prefetch, root_wait=root_wait,
                               timeout=timeout, **kwargs)


def _energon_batch_classes():
    """What Energon's own samples and batches are made of: the Sample and Batch classes
    megatron.energon exports, and SourceInfo (their ``__sources__``). A user's own Batch or
    Sample subclass is the user's to allow."""
    exported = (getattr(megatron.energon, name) for name in megatron.energon.__all__)
    return [c for c in exported if isinstance(c, type) and issubclass(c, (Sample, Batch))] + [SourceInfo]


class EnergonLeaderLoader(LeaderLoader):
    """Energon's SavableDataLoader, iterated on the group's leader only, with its API: iteration
    (as Energon's: with workers a new iter() continues the current pass while it yields), len(),
    save_state_rank / restore_state_rank, save_state_global / restore_state_global, close().
    Built by ``get_savable_loader(..., group=...)``."""

    def __init__(self, dataset, group, *, prefetch=None, root_wait=None, timeout=None, **kwargs):
        # As Energon's: with worker processes one iterator lives while it yields, and a new
        # iter() continues it; without, each iter() is a new DataLoader iterator (the data goes
        # on, and the DataLoader's base seed is drawn again).
        self._one_iterator = _check_group(dataset, group) > 0
        # The leader's WorkerConfig (followers may have none): the global variants' DP group.
        self.worker_config = dataset.worker_config if dataset is not None else None
        self._batches = None  # the iterator a new iter() continues, while its pass goes on
        # The trainer drives the passes (set_epoch=None): Energon's loaders have no set_epoch.
        super().__init__(lambda: _WireLoader(megatron.energon.get_savable_loader(dataset, **kwargs)),
                         group, sp_media_dedup=True, set_epoch=None,
                         state_hooks=(lambda wire: wire.loader.save_state_rank(),
                                      lambda wire, restore: restore(wire.loader)),
                         prefetch=prefetch, root_wait=root_wait, timeout=timeout)

    def __iter__(self):
        if self._batches is None or not self._one_iterator or self._closed:  # (closed: refused)
            self._batches = _Batches(self, super().__iter__())
        return self._batches

    def close(self):
        """LeaderLoader.close(), and on the leader Energon's worker processes with it."""
        energon = self.loader.loader if self.loader is not None else None
        super().close()
        # Energon's DataLoader hides behind _WireLoader, where LeaderLoader.close() does not see
        # its persistent workers; left to the garbage collector, each is joined only after a timeout.
        shut_down_workers(persistent_iterator(energon))

    def prefetch_policy(self, requested):
        # The state taken with batches in flight is Energon's save_state_rank() from before the
        # first of them ("snapshot"): its position is that of the batches the trainer took.
        workers = self.loader.loader.worker_config.num_workers
        if requested and workers == 0:
            raise Error(self._where() + f": prefetch={requested} with num_workers=0 in Energon's "
                        "WorkerConfig: each iter() of such a loader is a new iterator, which "
                        "would drop a batch fetched ahead; pass prefetch=0 or give Energon "
                        "workers", "invalid_argument")
        if requested is not None:
            return requested, f"prefetch={requested}", "snapshot"
        if workers == 0:
            return 0, ("num_workers=0 in Energon's WorkerConfig: its task encoder runs in this "
                       "process, and each iter() is a new iterator"), None
        # Energon's workers (seeded by its WorkerConfig) run the task encoder; in this process a
        # fetch draws from the default generator only where it starts the pass's iterator (the
        # DataLoader's base seed), which LeaderLoader keeps on the trainer's thread.
        return 1, f"Energon's SavableDataLoader with {workers} workers", "snapshot"

    def save_state_rank(self):
        """The leader's Energon state (``SavableDataLoader.save_state_rank()``) after the last
        batch the trainer took, not the prefetched ones; None on followers. Save the leader's,
        as Megatron-Bridge saves the state of tp = cp = pp = 0."""
        state = self.get_state_dict()
        return state["loader"] if state else None

    def restore_state_rank(self, state):
        """Restores Energon's state on the leader; call it on every rank of the group (followers
        may pass what their save_state_rank returned, None). What the leader's Energon raises
        for the state (a state of another dataset, workers already running) every rank of the
        group raises, as a spbcast.LoaderError that is also of Energon's exception type."""
        self._restore(lambda loader: loader.restore_state_rank(state))

    def save_state_global(self, global_dst_rank):
        """Energon's ``save_state_global`` among the leaders: each leader's save_state_rank()
        gathered over its WorkerConfig's data-parallel group to ``global_dst_rank``; None on
        followers, which call nothing (their data-parallel groups hold followers only)."""
        if not self.is_leader:
            return None
        # Energon's own gather, with this loader's save_state_rank and the leader's WorkerConfig.
        return SavableDataLoader.save_state_global(self, global_dst_rank)

    def restore_state_global(self, state, *, src_rank=None):
        """Energon's ``restore_state_global`` on the leaders (with ``src_rank``, a scatter over
        their data-parallel group); call it on every rank of the group, as restore_state_rank."""
        self._restore(lambda loader: loader.restore_state_global(state, src_rank=src_rank))

    def _restore(self, restore):
        # LeaderLoader.load_state_dict runs restore(leader's SavableDataLoader) on the leader and
        # raises its outcome on every rank of the group. Energon's state is the whole position:
        # LeaderLoader's own counters start again.
        position = None
        if self.is_leader:
            position = {"version": 2, "epoch": self.first_epoch, "pass": 0, "step": 0,
                        "in_epoch": 0, "epoch_value": None, "loader": restore}
        self.load_state_dict(position)


def _check_group(dataset, group):
    """Every rank of the group, before any other collective on it: the leader has a dataset, and
    every rank that has one reads the leader's data index (a group of one data-parallel rank's
    ranks, not the data-parallel group). Returns the leader's worker count (Energon's
    WorkerConfig.num_workers), which followers without a dataset learn here. One all_gather of
    three ints per rank."""
    where = f"spbcast: rank {dist.get_rank()} (spbcast.energon): get_savable_loader: "
    try:
        group._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError) as e:
        raise Error(where + "the group has no CPU backend (spbcast sends the CPU batch over it); "
                    "make it with dist.new_group(ranks, backend=\"gloo\")", "invalid_argument") from e
    config = dataset.worker_config if dataset is not None else None
    mine = torch.tensor([config.rank, config.world_size, config.num_workers] if config is not None
                        else [-1, -1, -1])
    configs = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(configs, mine, group=group)
    leader, (rank, size, workers) = dist.get_global_rank(group, 0), configs[0].tolist()
    if rank < 0:
        raise Error(where + f"the group's leader (rank {leader}) passed no dataset; build the dataset "
                    "on the leader (its lowest global rank) at least", "invalid_argument")
    for i, other in enumerate(configs):
        if other[0] >= 0 and other[:2].tolist() != [rank, size]:
            raise Error(where + f"rank {dist.get_global_rank(group, i)}'s dataset reads data-parallel "
                        f"rank {other[0]} of {other[1]} and the group's leader (rank {leader}) rank "
                        f"{rank} of {size} (their WorkerConfigs): the group must hold the ranks that "
                        "share one data index (tensor x context parallel), not the data-parallel "
                        "group", "invalid_argument")
    return workers


class _Batches:
    """The iterator EnergonLeaderLoader hands out: LeaderLoader's steps with the EPaths of each
    batch rebuilt; when its pass ends, the next iter() starts a new one."""

    def __init__(self, loader, steps):
        self._loader, self._steps = loader, steps

    def __iter__(self):
        return self

    def __next__(self):
        try:
            batch = next(self._steps)
        except StopIteration:
            self._loader._batches = None
            raise
        return _replace(batch, _EPathState, _epath)


class _WireLoader:
    """The leader's SavableDataLoader, its batches in the form spbcast carries: each EPath (the
    dataset path in a SourceInfo) as an _EPathState."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        return map(lambda batch: _replace(batch, EPath, _epath_state), iter(self.loader))

    def __len__(self):
        return len(self.loader)


@dataclasses.dataclass(frozen=True)
class _EPathState:
    """An EPath as it pickles (EPath.__getstate__: its path and storage profile, never its
    storage client), rebuilt on every rank as unpickling does (EPath.__setstate__)."""
    internal_path: str
    profile: str


def _epath_state(path):
    state = path.__getstate__()
    return _EPathState(str(state["internal_path"]), state["profile"])


def _epath(state):
    path = EPath.__new__(EPath)
    path.__setstate__({"internal_path": PurePosixPath(state.internal_path), "profile": state.profile})
    return path


def _replace(value, cls, convert):
    """value with each instance of cls in it replaced by convert(instance), through lists,
    tuples, dicts and dataclasses: in place where they are mutable (a batch belongs to this
    loader alone until it is returned), tuples rebuilt."""
    if isinstance(value, cls):
        return convert(value)
    if type(value) is list:
        for i, v in enumerate(value):
            value[i] = _replace(v, cls, convert)
    elif type(value) is tuple:
        return tuple(_replace(v, cls, convert) for v in value)
    elif type(value) is dict:
        for k, v in value.items():
            value[k] = _replace(v, cls, convert)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            # object.__setattr__: SourceInfo is a frozen dataclass
            object.__setattr__(value, f.name, _replace(getattr(value, f.name), cls, convert))
    return value
