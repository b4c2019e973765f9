"""spbcast.axolotl, axolotl's plugin for spbcast.accelerate, against axolotl's real plugin API.

Without axolotl: ``import spbcast.axolotl`` works, and asking for the plugin says what is missing.
With axolotl's plugin API importable (axolotl.integrations.base, axolotl.utils.config):
axolotl's ``prepare_plugins`` loads the plugin from the YAML's ``plugins:`` by its import path, it
is an axolotl ``BasePlugin``, axolotl's ``merge_input_args`` merges its ``spbcast:`` options into
the config schema (an unknown option is refused when the config is validated), and on 4 Gloo CPU
ranks with the (dp_shard 2, cp 2) mesh axolotl's ``PluginManager.post_trainer_create`` switches
spbcast on: the real Trainer's every rank equals BASE bit for bit (inputs, losses, grad norms,
generator, parameters), only the CP leaders load, and the config's options reach the loader.

axolotl's trainer (AxolotlTrainer) and its CLI are not run: axolotl's own pins (transformers,
accelerate, datasets, TRL) do not install beside this project's (docs/accelerate.md)."""

import subprocess
import sys

import pytest

def test_import_needs_no_axolotl():
    """axolotl hidden (not faked): the module imports; SpbcastPlugin is a clear ImportError."""
    code = ("import sys; sys.modules['axolotl'] = None\n"
            "import spbcast.axolotl\n"
            "try:\n    spbcast.axolotl.SpbcastPlugin\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('no ImportError')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "spbcast.axolotl.SpbcastPlugin is an axolotl plugin" in out.stdout, out.stdout
    assert "spbcast.accelerate.enable(trainer.accelerator)" in out.stdout, out.stdout


def _axolotl_plugin_api():
    pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup.sh installs it)")
    pytest.importorskip("axolotl.integrations.base", reason="axolotl's plugin API does not import here "
                        "(axolotl's pins do not install beside this project's; docs/accelerate.md)")
    return pytest.importorskip("axolotl.utils.config", reason="axolotl.utils.config does not import here")


def test_plugin_loads_from_the_config():
    _axolotl_plugin_api()
    import yaml
    from axolotl.integrations.base import BasePlugin, PluginManager
    from axolotl.integrations.config import merge_input_args
    from axolotl.utils.config import prepare_plugins
    from axolotl.utils.dict import DictDefault
    from pydantic import ValidationError

    import spbcast.axolotl
    from axolotl_ranks import CONFIG

    cfg = DictDefault(yaml.safe_load(CONFIG))
    prepare_plugins(cfg)
    plugin = PluginManager.get_instance().plugins["spbcast.axolotl.SpbcastPlugin"]
    assert isinstance(plugin, BasePlugin) and type(plugin) is spbcast.axolotl.SpbcastPlugin
    _, input_config = merge_input_args()
    assert issubclass(input_config, spbcast.axolotl.SpbcastArgs) and "spbcast" in input_config.model_fields
    assert spbcast.axolotl.SpbcastArgs(**cfg).spbcast == {"prefetch": 0}
    with pytest.raises(ValidationError, match="'prefetch_depth'.*its options are timeout"):
        spbcast.axolotl.SpbcastArgs(spbcast={"prefetch_depth": 1})


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    _axolotl_plugin_api()
    import accelerate_ranks as ar
    from axolotl_ranks import PluginArm

    root = str(tmp_path_factory.mktemp("axolotl"))
    return ar.run_arms(root, "plugin", [PluginArm("base", False), PluginArm("plugin", True)], timeout=180)


def test_plugin_switches_spbcast_on(runs):
    import accelerate_ranks as ar
    from test_accelerate import TRAINER_KEYS, only_leaders_load, same_run

    same_run(runs["base"], runs["plugin"], "axolotl plugin", TRAINER_KEYS)
    assert all(r["fetches"] > 0 for r in runs["base"])
    only_leaders_load("plugin", runs["plugin"])
    assert [r["prefetch"] for r in runs["base"]] == [None] * ar.WORLD
    assert [r["prefetch"] for r in runs["plugin"]] == [0] * ar.WORLD, "the config's spbcast: prefetch: 0"
