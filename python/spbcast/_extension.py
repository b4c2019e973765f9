"""Loads the compiled half of the package (spbcast._C) after checking that it was built for the
torch this process runs. A C++ extension is compiled against one torch's C++ ABI; under another
it fails to load with an undefined symbol, or loads and misbehaves, so a mismatch is refused by
name before the extension is touched."""

import torch

try:
    from ._build_info import BUILT_WITH_TORCH  # written by setup.py at build time
except ImportError:  # a source tree whose setup.py never ran: only the load itself can tell
    BUILT_WITH_TORCH = None

REBUILD = "pip install --no-build-isolation --no-deps --force-reinstall ./python"


def _wrong_torch(detail=""):
    built = f"torch {BUILT_WITH_TORCH}" if BUILT_WITH_TORCH else "another torch"
    return ImportError(
        f"spbcast: this spbcast was built for {built}, but this process runs torch "
        f"{torch.__version__}{detail}. A C++ extension runs only under the torch it was compiled "
        f"against: rebuild spbcast for this torch - from the spbcast repository, with this "
        f"environment active: {REBUILD}")


def load():
    if BUILT_WITH_TORCH is not None and BUILT_WITH_TORCH != str(torch.__version__):
        raise _wrong_torch()
    try:
        from . import _C
    except ImportError as e:
        if "undefined symbol" in str(e):
            raise _wrong_torch(f" (loading the extension failed: {e})") from e
        raise
    return _C
