"""verl: only the leader of each Ulysses sequence-parallel group iterates the SFT trainer's train
loader; the group's other ranks get its batches.

    spbcast.verl.enable()       # every rank, before verl's SFTTrainer is built

verl's ``SFTTrainer`` (``verl.trainer.sft_trainer``) builds its train loader in
``_build_dataloader``: a torchdata ``StatefulDataLoader`` over a ``DistributedSampler`` indexed by
the engine's data-parallel rank. With the FSDP engine's Ulysses mesh, (dp, sp) with the sp
dimension innermost, the ranks of one SP group are consecutive and share that dp rank: each of
them reads, tokenizes and (with a processor) decodes the same samples, and the split happens in
the model. After ``enable``, every train loader an ``SFTTrainer`` builds stays verl's
``StatefulDataLoader`` on every rank - its ``len()``, its sampler (``set_epoch``), its dataset and
collator - and only its iteration and state change: the group's leader (SP rank 0) iterates its
own through a ``LeaderLoader``, and every rank of the group gets the leader's collated batch over
a Gloo group of the group's ranks, with the loader's ``state_dict()`` after that batch. So
``state_dict()`` (what verl's ``CheckpointHandler`` saves as ``data_<dp>.pt``) is the leader's on
every rank, and ``load_state_dict`` (which the handler calls on every rank) restores the leader's
next pass. Each follower's default CPU generator advances as its own loader would have advanced it.

Refused on every rank, before any collective: another engine than FSDP (its data path groups the
ranks by its own parallel state), Ulysses SP 1 (verl gives every rank data of its own: nothing to
share), and a mesh whose SP groups are not blocks of consecutive ranks. The validation loader is
left as it is. This module imports verl only when ``enable`` runs; ``import spbcast`` does not.
"""

import functools

import torch
import torch.distributed as dist
import torch.utils.data

from ._broadcast import _group_timeout
from ._drop_in import check_options, data_index_groups
from ._loader.prefetch import default_policy
from .errors import Error
from .loader import LeaderLoader

__all__ = ["enable", "stats"]

_INSTALLED = {}  # what enable() replaced, once per process: the original and the options
_ENGINES = ("fsdp", "fsdp2")  # verl's FSDP engine (FSDPEngine): the Ulysses (dp, sp) mesh


def _where():
    return f"spbcast: rank {dist.get_rank() if dist.is_initialized() else 0} (spbcast.verl)"


def enable(**options):
    """From now on (process-wide), every train loader a verl ``SFTTrainer`` builds is iterated
    only by the leader of each Ulysses SP group; the others receive its batches. ``options``:
    LeaderLoader's ``timeout``, ``root_wait``, ``transport``, ``relay_chunk_bytes``,
    ``leader_allocates_in_shared_memory``, ``prefetch``, ``log_every``, ``log``. Call it on every
    rank, before the trainer is built; calling it again replaces the options. Trainers built
    before it are left as they are."""
    check_options(_where(), options)
    from verl.trainer.sft_trainer import SFTTrainer

    _INSTALLED["options"] = dict(options)
    if "build_dataloader" in _INSTALLED:
        return
    build_dataloader = _INSTALLED["build_dataloader"] = SFTTrainer._build_dataloader

    def shared_build_dataloader(self):
        build_dataloader(self)
        _share(self, _INSTALLED["options"])

    # SFTTrainer.__init__ reaches it through its class; the CheckpointHandler and fit() are given
    # the loader it leaves in self.train_dataloader.
    SFTTrainer._build_dataloader = shared_build_dataloader


def stats(loader):
    """``LeaderLoader.stats()`` of a train loader built after ``enable`` (on every rank: the
    path, steps, bytes, prefetch depth and hits, the waits), or None where it is verl's own."""
    shared = getattr(loader, "__dict__", {}).get("shared")
    return shared.leader_loader.stats() if isinstance(shared, _Shared) else None


def _share(trainer, options):
    # Decided alike on every rank (the same configuration and mesh), before the first collective
    # of spbcast: a refusal leaves no rank waiting.
    from torchdata.stateful_dataloader import StatefulDataLoader

    strategy = trainer.engine_config.strategy
    if strategy not in _ENGINES:
        raise Error(_where() + f": verl's {strategy!r} engine groups the ranks by its own parallel "
                    "state, not by the FSDP engine's Ulysses (dp, sp) mesh that spbcast.verl shares; "
                    "use engine=fsdp, or do not call spbcast.verl.enable", "invalid_argument")
    size = trainer.engine_config.ulysses_sequence_parallel_size
    if size <= 1:
        raise Error(_where() + f": ulysses_sequence_parallel_size {size}: verl gives every rank "
                    "samples of its own (its dp rank is its rank), so no rank's batches can be "
                    "shared; set engine.ulysses_sequence_parallel_size > 1, or do not call "
                    "spbcast.verl.enable", "invalid_argument")
    if not dist.is_initialized():
        raise Error(_where() + ": Ulysses sequence parallelism without torch.distributed initialized",
                    "invalid_argument")
    engine, world, rank = trainer.engine, dist.get_world_size(), dist.get_rank()
    block = list(range(rank - rank % size, rank - rank % size + size))
    mesh = getattr(engine, "ulysses_device_mesh", None)
    sp_ranks = None if mesh is None else dist.get_process_group_ranks(mesh["sp"].get_group())
    if (world % size or engine.get_data_parallel_rank() != rank // size
            or engine.get_data_parallel_size() != world // size or sp_ranks != block):
        raise Error(_where() + f": verl's data rank {engine.get_data_parallel_rank()} of "
                    f"{engine.get_data_parallel_size()} and SP group {sp_ranks} (sp {size}, world "
                    f"{world}) are not this rank's block of consecutive ranks {block}; spbcast.verl "
                    "groups the ranks as the FSDP engine's (dp, sp) mesh does: run one process per "
                    "rank of the default group, or do not call spbcast.verl.enable", "invalid_argument")
    loader = trainer.train_dataloader
    if type(loader) is not StatefulDataLoader:
        raise Error(_where() + f": verl built a {type(loader).__name__} as the train loader, not the "
                    "StatefulDataLoader that spbcast.verl shares; this verl is not one spbcast.verl "
                    "knows: do not call spbcast.verl.enable", "invalid_argument")
    group = data_index_groups(world, size, _group_timeout(None))[rank // size]
    shared = _Shared(loader, group, options)
    # The same object on every rank (verl's sampler, dataset, CheckpointHandler hold it); its
    # class now iterates the leader's broadcast and keeps the leader's state.
    loader.__class__ = _shared_class()
    loader.shared = shared


@functools.cache
def _shared_class():
    """A subclass of torchdata's StatefulDataLoader (made once, when verl is there): ``isinstance``
    holds, and everything but the iteration and the state is verl's loader's."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    class SharedStatefulDataLoader(StatefulDataLoader):
        """verl's train loader after _share: iterating it is the SP leader's pass, broadcast."""

        def __iter__(self):
            return self.shared.iterate()

        def state_dict(self):
            state = self.shared.state
            if state is None:  # before its first batch: the loader's own, as in BASE
                state = StatefulDataLoader.state_dict(self)
                if not self.shared.leader_loader.is_leader:
                    # The iterator that made it (its workers, their prefetched samples) is one a
                    # follower never iterates: dropped, its workers end.
                    StatefulDataLoader.load_state_dict(self, {})
            return state

        def load_state_dict(self, state):
            # On every rank, as verl's CheckpointHandler calls it: the leader's next pass starts
            # from it; a follower keeps it and never iterates.
            StatefulDataLoader.load_state_dict(self, state)
            self.shared.state = None

    SharedStatefulDataLoader.__name__ = SharedStatefulDataLoader.__qualname__ = "StatefulDataLoader"
    return SharedStatefulDataLoader


class _Shared:
    """What the ranks of one SP group share for one train loader: the LeaderLoader (made on every
    rank of the group) and the loader's state after the last batch this rank took."""

    def __init__(self, loader, group, options):
        self.loader, self.state = loader, None
        self.leader_loader = _VerlLeaderLoader(loader, group, **options)

    def iterate(self):
        # A generator: nothing runs (not even the leader's iterator, which draws the pass's base
        # seed) before fit()'s first next().
        for batch, state in self.leader_loader:
            self.state = state
            yield batch


class _VerlLeaderLoader(LeaderLoader):
    """The LeaderLoader of one train loader: on the leader it iterates the StatefulDataLoader as
    torchdata does, each batch with the loader's state after it."""

    def __init__(self, loader, group, **options):
        self._loader = loader
        # fit() drives the passes: one pass per iter(), set_epoch on the sampler itself.
        super().__init__(lambda: _Passes(loader), group, sp_media_dedup=True, set_epoch=None, **options)

    def prefetch_policy(self, requested):
        # The loader's state needs no snapshot: the state after each batch travels with it, taken
        # when it was fetched. With workers, the fetch runs in them except the batch sampler,
        # which runs here: torchdata's BatchSampler over verl's DistributedSampler (which draws
        # from a generator of its own, seeded by the epoch) draws nothing from the default CPU
        # generator after the pass's iterator was made on the trainer's thread, as in BASE.
        from torchdata.stateful_dataloader.sampler import BatchSampler

        loader = self._loader
        if (requested is None and loader.num_workers > 0 and type(loader.batch_sampler) is BatchSampler
                and type(loader.sampler) is torch.utils.data.DistributedSampler):
            return 1, f"verl's StatefulDataLoader with {loader.num_workers} workers", None
        return default_policy(loader, requested, False)


class _Passes:
    """What the leader's LeaderLoader iterates: each pass is torchdata's iteration of verl's
    StatefulDataLoader, each batch with ``state_dict()`` after it."""

    def __init__(self, loader):
        self.loader = loader

    def __iter__(self):
        from torchdata.stateful_dataloader import StatefulDataLoader

        loader = self.loader
        batches = StatefulDataLoader.__iter__(loader)
        return ((batch, StatefulDataLoader.state_dict(loader)) for batch in batches)

    def __len__(self):
        return len(self.loader)
