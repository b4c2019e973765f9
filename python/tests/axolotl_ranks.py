"""The axolotl plugin line on 4 CPU ranks, for test_axolotl.py: transformers' real Trainer as
accelerate_ranks.py runs it, under the (dp_shard 2, cp 2) mesh of axolotl's context parallelism,
with spbcast switched on the way axolotl switches a plugin on: each rank reads the YAML config,
axolotl's own ``prepare_plugins`` registers ``plugins:`` (importing the plugin by its path), and
axolotl's ``PluginManager.post_trainer_create(cfg, trainer)`` runs the hook before ``train()``."""

import dataclasses

import yaml
from axolotl.integrations.base import PluginManager
from axolotl.utils.config import prepare_plugins
from axolotl.utils.dict import DictDefault

import accelerate_ranks as ar

CONFIG = """
plugins:
  - spbcast.axolotl.SpbcastPlugin
spbcast:
  prefetch: 0
"""


@dataclasses.dataclass
class PluginArm(ar.TrainerArm):
    """A TrainerArm whose dedup is axolotl's plugin line (CONFIG)."""
    workers: int = 2
    shared_dim: str = "cp"


def _train_with_plugin(arm, rank, mesh, root):
    cfg = DictDefault(yaml.safe_load(CONFIG))
    if arm.dedup:
        prepare_plugins(cfg)
    return ar._train(arm, rank, mesh, root,
                     enable=lambda trainer: PluginManager.get_instance().post_trainer_create(cfg, trainer))


ar.RUNNERS[PluginArm] = _train_with_plugin
