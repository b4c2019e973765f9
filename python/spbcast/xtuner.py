"""SP media dedup for XTuner v1's own Trainer, switched by one config field.

    from spbcast.xtuner import DataloaderConfig        # XTuner's, plus sp_media_dedup
    dataloader_cfg = DataloaderConfig(..., sp_media_dedup=True)

XTuner's Trainer builds its dataloader with ``dataloader_cfg.build(...)`` on every rank, between
building its data mesh and loading a checkpoint; that call is where the switch comes in. Off (the
default), at SP size 1, or where XTuner's config is used, the dataloader is XTuner's as shipped.
On, XTuner's ``DataloaderConfig.build`` still runs on every rank (building the datasets is a
collective over the world), and the result is wrapped in ``XTunerLeaderLoader``: only the SP leader
iterates it; each step one broadcast over the SP group carries the collated batch to the
followers, before the Trainer's ``_prepare_model_input``.

Checkpoints stay XTuner's: the dedup leader's ``get_state_dict()`` is its Dataloader's, nothing
added, so plain XTuner resumes it; a state XTuner wrote (or ``LeaderLoader`` wrote before this
module) resumes under dedup. What ``LeaderLoader`` tracks besides (the epoch, the steps taken) is
derived from XTuner's own keys.

This module imports XTuner; ``import spbcast`` does not import it.
"""

import contextlib

import torch
import torch.distributed as dist
from pydantic import ConfigDict
from xtuner.v1.data_proto.sequence_context import DSATopKCacheState, SequenceContext
from xtuner.v1.datasets.config import DataloaderConfig as _XTunerDataloaderConfig
from xtuner.v1.utils import get_logger

from ._loader.resume import STATE_VERSIONS
from ._wire import allow_classes
from .errors import Error, loader_error
from .loader import LeaderLoader

__all__ = ["DataloaderConfig", "XTunerLeaderLoader"]

# The keys XTuner's Dataloader.get_state_dict writes and its load_state_dict reads.
_XTUNER_KEYS = ("sampler", "dataset", "total_consumed_samples")


def _where():
    return f"spbcast: rank {dist.get_rank() if dist.is_initialized() else 0} (spbcast.xtuner)"


def _root_mesh(mesh):
    """The mesh ``mesh`` was sliced from (itself if it was not), or None where this torch keeps
    it nowhere spbcast knows. torch-internal, named here only: ``DeviceMesh._get_root_mesh()``
    from torch 2.10 on, ``torch.distributed.device_mesh._mesh_resources.get_root_mesh(mesh)``
    from 2.2 (deprecated from 2.10, where it calls the former)."""
    root_of = getattr(mesh, "_get_root_mesh", None)
    if callable(root_of):
        return root_of()
    try:
        from torch.distributed.device_mesh import _mesh_resources
    except ImportError:
        return None
    get_root_mesh = getattr(_mesh_resources, "get_root_mesh", None)
    return get_root_mesh(mesh) if callable(get_root_mesh) else None


# The data meshes of XTuner's that the switch knows: its Trainer's (Trainer._init_data_mesh) and
# its RL training worker's (TrainingWorker's data mesh, no TP).
_KNOWN_MESHES = (("dp", "sp", "tp"), ("dp", "sp"))


def _layout(dp_mesh):
    """The SP process group (None: no SP dimension) and the TP size of XTuner's data mesh, from
    the DP mesh DataloaderConfig.build receives: the "dp" dimension of a (dp, sp, tp) mesh
    (XTuner's Trainer) or of a (dp, sp) mesh (its RL training worker). The other dimensions come
    from that mesh's root; a mesh of another shape is a clear error, never a wrong group."""
    where = _where() + ": sp_media_dedup: "
    if dp_mesh is None:  # no data mesh (XTuner's RL prompt sampler): no SP group
        return None, 1
    root = _root_mesh(dp_mesh)
    if root is None:
        raise Error(where + f"cannot find the data mesh the dp_mesh DataloaderConfig.build received "
                    f"was sliced from: this torch ({torch.__version__}) keeps a DeviceMesh's root "
                    "neither in DeviceMesh._get_root_mesh() nor in device_mesh._mesh_resources; "
                    "turn sp_media_dedup off", "invalid_argument")
    names = tuple(root.mesh_dim_names or ())
    if root is dp_mesh or names == ("dp",):
        return None, 1  # a DP mesh of its own: no SP dimension
    if names not in _KNOWN_MESHES or not torch.equal(root["dp"].mesh, dp_mesh.mesh):
        raise Error(where + "the dp_mesh DataloaderConfig.build received is not the \"dp\" dimension "
                    "of a (dp, sp, tp) data mesh, as XTuner's Trainer._init_data_mesh builds it, nor "
                    f"of a (dp, sp) one, as its RL worker does (its root mesh has dimensions {names} "
                    f"and shape {tuple(root.mesh.shape)}); this XTuner is not one spbcast.xtuner "
                    "knows: turn sp_media_dedup off", "invalid_argument")
    return root["sp"].get_group(), (root["tp"].size() if "tp" in names else 1)


class XTunerLeaderLoader(LeaderLoader):
    """XTuner's Dataloader, iterated on the SP leader only, as XTuner's Trainer drives it
    (epochs from 1, its set_epoch, get_state_dict on every rank, rank 0's state loaded on every
    rank). Built by ``DataloaderConfig.build`` with ``sp_media_dedup=True``."""

    def __init__(self, dataloader, sp_group, *, batch_samples, root_wait=None, prefetch=None):
        # XTuner's own loop drives the passes (set_epoch=None), numbered from 1.
        # Its summary of the broadcasts goes to XTuner's own log, where its users look.
        super().__init__(lambda: dataloader, sp_group, sp_media_dedup=True, first_epoch=1,
                         set_epoch=None, root_wait=root_wait, prefetch=prefetch,
                         log=lambda line: get_logger().info(line))
        self._batch_samples = batch_samples  # samples per step over the DP group

    def prefetch_policy(self, requested):
        # XTuner's pipeline (its samplers, datasets, packing and collator) draws nothing from
        # the default CPU generator while fetching, with or without workers: it seeds
        # generators of its own (test_xtuner_trainer.py checks every rank's generator against
        # BASE with prefetch on). Its Dataloader counts the samples it yields (_local_samples),
        # which rewound() takes back by the batches fetched ahead.
        depth = 1 if requested is None else requested
        return depth, ("XTuner's Dataloader" if requested is None else f"prefetch={requested}"), "rewind"

    @contextlib.contextmanager
    def rewound(self, batches):
        # torch-internal to XTuner, named here only: Dataloader._local_samples, which its
        # __iter__ raises by len(batch) as it yields a batch and get_state_dict reads.
        samples = sum(len(batch) for batch in batches)
        if not hasattr(self.loader, "_local_samples"):
            raise Error(self._where() + ": this XTuner's Dataloader has no _local_samples, which "
                        "spbcast takes back by the prefetched batches when a checkpoint is saved; "
                        "set sp_media_dedup_prefetch=0", "invalid_argument")
        self.loader._local_samples -= samples
        try:
            yield
        finally:
            self.loader._local_samples += samples

    def get_state_dict(self):
        """XTuner's Dataloader state, exactly (a collective of the leaders over their DP group,
        as in BASE); {} on followers."""
        state = super().get_state_dict()
        return state["loader"] if state else {}

    def load_state_dict(self, state):
        """A state XTuner's Dataloader wrote (with or without dedup), or one LeaderLoader wrote,
        loaded on every rank (they all load the same file), as XTuner's Trainer does: the leader's
        Dataloader restores it at once, and a state it cannot load raises on every SP rank, in
        Trainer(...), what XTuner raises in BASE (a KeyError for a missing key, XTuner's
        ValueError for a dataset that changed), as a spbcast.LoaderError of that type."""
        xtuner_state, position = self._split(state)
        if position is None:
            position = self._position(xtuner_state)
        super().load_state_dict(dict(position, loader=xtuner_state))

    def _split(self, state):
        where = self._where() + ": load_state_dict: "
        if not isinstance(state, dict):  # XTuner's load would index it: a TypeError
            message = (f"the dataloader state is a {type(state).__name__}, not the dict XTuner's "
                       "Dataloader.get_state_dict writes; resume from a checkpoint XTuner's Trainer saved")
            raise loader_error(where + message, "TypeError", message, TypeError)
        position = None
        if "version" in state and "loader" in state:  # LeaderLoader.state_dict's own layout
            if state["version"] not in STATE_VERSIONS:
                raise Error(where + f"the dataloader state is LeaderLoader's version "
                            f"{state['version']!r}, which this spbcast does not know (1 to "
                            f"{STATE_VERSIONS[-1]}); "
                            "resume with the spbcast that wrote it", "version_mismatch")
            position = {k: v for k, v in state.items() if k != "loader"}
            state = state["loader"]
        missing = [k for k in _XTUNER_KEYS if not isinstance(state, dict) or k not in state]
        if missing:  # XTuner's load would raise KeyError (TypeError for a state that is no dict)
            have = sorted(state) if isinstance(state, dict) else type(state).__name__
            error = KeyError if isinstance(state, dict) else TypeError
            raise loader_error(where + f"the dataloader state lacks {', '.join(map(repr, missing))} (it "
                               f"has {have}): it is not a state XTuner's Dataloader.get_state_dict "
                               "wrote; resume from a checkpoint XTuner's Trainer saved",
                               error.__name__, repr(missing[0]), error)
        return state, position

    def _position(self, state):
        """LeaderLoader's position in a state XTuner wrote: XTuner's sampler keeps its epoch (0
        until the trainer's first set_epoch(2)) and XTuner counts the samples consumed over the
        DP group (its sampler's step is that count within the epoch)."""
        sampler = state["sampler"]
        epoch = max(int(sampler.get("epoch", 0)), self.first_epoch)
        step = int(state["total_consumed_samples"]) // self._batch_samples
        in_epoch = int(sampler.get("step", 0)) // self._batch_samples
        return {"version": 2, "epoch": epoch, "pass": epoch - self.first_epoch, "step": step,
                "in_epoch": in_epoch, "epoch_value": epoch if epoch > self.first_epoch else None}


class DataloaderConfig(_XTunerDataloaderConfig):
    """XTuner v1's DataloaderConfig with ``sp_media_dedup`` (off by default): on, only the SP
    leader of each SP group runs the sampler, the DataLoader and its workers, the collator; the
    followers get each step's batch from it over the SP group."""

    model_config = ConfigDict(title="XTuner's dataloader config with spbcast's SP media dedup",
                              extra="forbid", arbitrary_types_allowed=True)

    sp_media_dedup: bool = False
    # Seconds a step's first message waits for an SP rank late outside the loader (rank 0 saving
    # a checkpoint, an after-save hook; a follower writing its shard). None: the SP group's own
    # timeout, exactly as long as BASE's next collective on it waits.
    sp_media_dedup_root_wait: float | None = None
    # Batches the SP leader fetches and broadcasts ahead, while the step runs (0: each step's
    # batch is fetched and sent when the Trainer asks for it).
    sp_media_dedup_prefetch: int = 1

    def build(self, tokenizer, dp_mesh, global_batch_size, micro_batch_size, seed, shuffle=True,
              total_step=None):
        kwargs = dict(tokenizer=tokenizer, dp_mesh=dp_mesh, global_batch_size=global_batch_size,
                      micro_batch_size=micro_batch_size, seed=seed, shuffle=shuffle,
                      total_step=total_step)
        if not self.sp_media_dedup:
            return super().build(**kwargs)
        # Checked on every rank before the datasets' first collective.
        sp_group, tp_size = _layout(dp_mesh)
        if sp_group is None or dist.get_world_size(sp_group) == 1:
            return super().build(**kwargs)
        if tp_size != 1:
            raise Error(_where() + f": sp_media_dedup requires TP size 1 (XTuner's data mesh has "
                        f"tp {tp_size}); set FSDPConfig(tp_size=1) or sp_media_dedup=False",
                        "invalid_argument")
        try:
            sp_group._get_backend(torch.device("cpu"))
        except (RuntimeError, AttributeError) as e:
            raise Error(_where() + ": sp_media_dedup: the SP group has no CPU backend (spbcast sends "
                        "the CPU batch over it); give the trainer dist_backend=\"cpu:gloo,cuda:nccl\" "
                        f"(XTuner's default on GPUs) or \"gloo\": {e}", "invalid_argument") from e
        # What XTuner's batches hold besides dicts, lists and tensors.
        allow_classes(SequenceContext, DSATopKCacheState)
        dataloader = super().build(**kwargs)  # every rank: the datasets are built collectively
        return XTunerLeaderLoader(dataloader, sp_group, batch_samples=micro_batch_size * dp_mesh.size(),
                                  root_wait=self.sp_media_dedup_root_wait,
                                  prefetch=self.sp_media_dedup_prefetch)
