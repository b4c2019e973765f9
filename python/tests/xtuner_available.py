"""Whether XTuner v1's data pipeline can be imported here, found without importing it (importing
XTuner takes seconds): the test modules skip, saying why, when it cannot."""

import importlib.util
import os

# Modules the pipeline needs besides XTuner itself (docs/xtuner.md).
_NEEDED = ("mmengine", "transformers", "tokenizers", "datasets", "cyclopts", "xxhash", "addict",
           "termcolor", "yaml", "rich", "loguru", "pydantic", "PIL", "numpy")



def unavailable():
    """Why XTuner v1's data pipeline cannot be imported here, or None. Imports nothing heavy."""
    spec = importlib.util.find_spec("xtuner")
    if spec is None or not spec.submodule_search_locations:
        return "xtuner is not installed"
    root = list(spec.submodule_search_locations)[0]
    if not os.path.isfile(os.path.join(root, "v1", "datasets", "dataloader.py")):
        return (f"the installed xtuner ({root}) has no xtuner/v1 (the PyPI xtuner 0.2.0 is the older "
                "code; XTuner v1 is built from its GitHub main)")
    missing = [m for m in _NEEDED if importlib.util.find_spec(m) is None]
    if missing:
        return f"XTuner v1's data pipeline needs {', '.join(missing)}, not installed"
    return None


def skip_without_xtuner():
    """The pytest mark of a test module that needs XTuner v1: skipped, saying why and how to
    install it, where it is not importable."""
    import pytest

    reason = unavailable()
    return pytest.mark.skipif(
        reason is not None,
        reason=f"XTuner v1 is not importable here ({reason}); ./scripts/setup.sh installs "
               "../shared/wheels/xtuner-*.whl or $SPBCAST_XTUNER_WHEEL with its pure-Python dependencies "
               "into an overlay beside the environment, <venv>-xtuner, and ./scripts/test.sh runs these "
               "tests there (docs/building.md)")
