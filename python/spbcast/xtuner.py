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

import torch
import torch.distributed as dist
from pydantic import ConfigDict
from xtuner.v1.data_proto.sequence_context import DSATopKCacheState, SequenceContext
from xtuner.v1.datasets.config import DataloaderConfig as _XTunerDataloaderConfig

from ._wire import allow_classes
from .errors import Error
from .loader import LeaderLoader

__all__ = ["DataloaderConfig", "XTunerLeaderLoader"]

# The keys XTuner's Dataloader.get_state_dict writes and its load_state_dict reads.
_XTUNER_KEYS = ("sampler", "dataset", "total_consumed_samples")


def _where():
    return f"spbcast: rank {dist.get_rank() if dist.is_initialized() else 0} (spbcast.xtuner)"


def _layout(dp_mesh):
    """The SP process group and the TP size of XTuner's data mesh, from the DP mesh that
    DataloaderConfig.build receives. XTuner's Trainer builds one (dp, sp, tp) mesh
    (Trainer._init_data_mesh) and passes its "dp" dimension; the other two dimensions come from
    that mesh's root, which torch keeps as DeviceMesh._get_root_mesh() (torch-internal: checked
    here by structure, so an XTuner or torch of another shape is a clear error, not a wrong
    group)."""
    where = _where() + ": sp_media_dedup: "
    root_of = getattr(dp_mesh, "_get_root_mesh", None)
    if not callable(root_of):
        raise Error(where + f"the dp_mesh DataloaderConfig.build received ({type(dp_mesh).__name__}) "
                    "has no _get_root_mesh(); this torch's DeviceMesh is not one spbcast.xtuner "
                    "knows: turn sp_media_dedup off", "invalid_argument")
    root = root_of()
    if tuple(root.mesh_dim_names or ()) != ("dp", "sp", "tp") or not torch.equal(
            root["dp"].mesh, dp_mesh.mesh):
        raise Error(where + "the dp_mesh DataloaderConfig.build received is not the \"dp\" dimension "
                    "of a (dp, sp, tp) data mesh (its root mesh has dimensions "
                    f"{root.mesh_dim_names}), as XTuner's Trainer._init_data_mesh builds it; this "
                    "XTuner is not one spbcast.xtuner knows: turn sp_media_dedup off",
                    "invalid_argument")
    return root["sp"].get_group(), root["tp"].size()


class XTunerLeaderLoader(LeaderLoader):
    """XTuner's Dataloader, iterated on the SP leader only, as XTuner's Trainer drives it
    (epochs from 1, its set_epoch, get_state_dict on every rank, rank 0's state loaded on every
    rank). Built by ``DataloaderConfig.build`` with ``sp_media_dedup=True``."""

    def __init__(self, dataloader, sp_group, *, batch_samples):
        # XTuner's own loop drives the passes (set_epoch=None), numbered from 1.
        super().__init__(lambda: dataloader, sp_group, sp_media_dedup=True, first_epoch=1,
                         set_epoch=None)
        self._batch_samples = batch_samples  # samples per step over the DP group

    def get_state_dict(self):
        """XTuner's Dataloader state, exactly (a collective of the leaders over their DP group,
        as in BASE); {} on followers."""
        state = super().get_state_dict()
        return state["loader"] if state else {}

    def load_state_dict(self, state):
        """A state XTuner's Dataloader wrote (with or without dedup), or one LeaderLoader wrote,
        loaded on every rank: each rank checks it (they all load the same file), the leader
        restores it at its next fetch."""
        xtuner_state, position = self._split(state)
        if position is None:
            position = self._position(xtuner_state)
        super().load_state_dict(dict(position, loader=xtuner_state))

    def _split(self, state):
        where = self._where() + ": load_state_dict: "
        if not isinstance(state, dict):
            raise Error(where + f"the dataloader state is a {type(state).__name__}, not the dict "
                        "XTuner's Dataloader.get_state_dict writes; resume from a checkpoint "
                        "XTuner's Trainer saved", "invalid_argument")
        position = None
        if "version" in state and "loader" in state:  # LeaderLoader.state_dict's own layout
            if state["version"] not in (1, 2):
                raise Error(where + f"the dataloader state is LeaderLoader's version "
                            f"{state['version']!r}, which this spbcast does not know (1 and 2); "
                            "resume with the spbcast that wrote it", "version_mismatch")
            position = {k: v for k, v in state.items() if k != "loader"}
            state = state["loader"]
        missing = [k for k in _XTUNER_KEYS if not isinstance(state, dict) or k not in state]
        if missing:
            have = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise Error(where + f"the dataloader state lacks {', '.join(map(repr, missing))} (it has "
                        f"{have}): it is not a state XTuner's Dataloader.get_state_dict wrote; "
                        "resume from a checkpoint XTuner's Trainer saved", "invalid_argument")
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

    def build(self, tokenizer, dp_mesh, global_batch_size, micro_batch_size, seed, shuffle=True,
              total_step=None):
        kwargs = dict(tokenizer=tokenizer, dp_mesh=dp_mesh, global_batch_size=global_batch_size,
                      micro_batch_size=micro_batch_size, seed=seed, shuffle=shuffle,
                      total_step=total_step)
        if not self.sp_media_dedup:
            return super().build(**kwargs)
        # Checked on every rank before the datasets' first collective.
        sp_group, tp_size = _layout(dp_mesh)
        if dist.get_world_size(sp_group) == 1:
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
        dp_size = dp_mesh.size() if dp_mesh is not None else 1
        return XTunerLeaderLoader(dataloader, sp_group, batch_samples=micro_batch_size * dp_size)
