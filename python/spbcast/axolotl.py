"""axolotl: ``spbcast.accelerate.enable`` for the trainer axolotl builds, as an axolotl plugin.

In the axolotl config (YAML):

    plugins:
      - spbcast.axolotl.SpbcastPlugin
    spbcast:               # optional: enable()'s options (LeaderLoader's), e.g.
      prefetch: 0

axolotl imports the plugin by that path on every rank and calls its ``post_trainer_create(cfg,
trainer)`` after it builds the trainer and before ``train()`` prepares the train loader; the plugin
calls ``spbcast.accelerate.enable(trainer.accelerator, **cfg.spbcast)``. With
``context_parallel_size`` / ``tensor_parallel_size`` above 1, axolotl's accelerator holds a
device mesh whose ``cp`` / ``tp`` ranks share a data index, and only the lowest rank of each such
group iterates the loader; without them the loader stays accelerate's own.

The classes subclass axolotl's ``BasePlugin`` and pydantic's ``BaseModel``, so they are made when
first asked for (``spbcast.axolotl.SpbcastPlugin``): ``import spbcast.axolotl`` needs neither
axolotl nor accelerate, and ``import spbcast`` does not import this module.
"""

__all__ = ["SpbcastPlugin", "SpbcastArgs"]


def _args_class():
    """The plugin's part of axolotl's config schema: the ``spbcast:`` options, checked when axolotl
    validates the config (axolotl merges this model into its own)."""
    from pydantic import BaseModel, field_validator

    from ._drop_in import OPTIONS

    class SpbcastArgs(BaseModel):
        """``spbcast:`` in the axolotl config: the options of ``spbcast.accelerate.enable``."""

        spbcast: dict | None = None

        @field_validator("spbcast")
        @classmethod
        def _known_options(cls, options):
            unknown = sorted(set(options or ()) - set(OPTIONS))
            if unknown:
                raise ValueError(f"spbcast: {', '.join(map(repr, unknown))} in the axolotl config's "
                                 f"spbcast: section; its options are {', '.join(OPTIONS)}")
            return options

    return SpbcastArgs


def _plugin_class():
    try:
        from axolotl.integrations.base import BasePlugin
    except ImportError as e:
        raise ImportError(
            "spbcast.axolotl.SpbcastPlugin is an axolotl plugin, and axolotl's plugin API "
            f"(axolotl.integrations.base) does not import here: {e}. Install axolotl, or without it "
            "call spbcast.accelerate.enable(trainer.accelerator) before trainer.train()") from e
    from . import accelerate

    class SpbcastPlugin(BasePlugin):
        """Only one rank of each group that accelerate gives the same data index (tp x cp)
        iterates the train loader; the others receive its batches (``spbcast.accelerate``)."""

        def get_input_args(self):
            return f"{__name__}.SpbcastArgs"

        def post_trainer_create(self, cfg, trainer):
            accelerate.enable(trainer.accelerator, **dict(cfg.get("spbcast") or {}))

    return SpbcastPlugin


_MAKERS = {"SpbcastPlugin": _plugin_class, "SpbcastArgs": _args_class}


def __getattr__(name):
    # Module attributes made on first use (PEP 562): axolotl's load_plugin and merge_input_args
    # reach them with getattr / from-import.
    if name not in _MAKERS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    made = _MAKERS[name]()
    made.__module__, made.__qualname__ = __name__, name
    globals()[name] = made
    return made
