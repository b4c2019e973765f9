"""spbcast: broadcast a training batch from the SP leader to every rank of a sequence-parallel
group, bit-exactly, with tensor identity and views preserved.

    batch = spbcast.broadcast(batch if leader else None, group=sp_group, src=leader_rank)

Followers rebuild only built-in kinds and the classes the program allows, on every rank:

    spbcast.allow_classes(SequenceContext)   # or spbcast.allow_modules("mypkg")
"""

from importlib.metadata import PackageNotFoundError as _PackageNotFoundError
from importlib.metadata import version as _version

from . import _extension

_extension.load()  # first: a clear error when the extension was built for another torch

from ._broadcast import broadcast
from ._C import receive_cache_statistics, set_receive_cache_limit
from ._shared_memory import (close_same_host_channels, release_shared_memory, set_receive_cache_limits,
                             set_shared_memory_limit, set_shared_memory_limits, shared_memory,
                             shared_memory_statistics)
from ._wire import allow_classes, allow_modules
from .errors import Error, LoaderError, RemoteError, ResumeWarning, SchemaError, TransportError
from .loader import LeaderLoader

__all__ = ["broadcast", "LeaderLoader", "allow_classes", "allow_modules", "Error", "LoaderError", "RemoteError", "ResumeWarning",
           "SchemaError", "TransportError",
           "set_receive_cache_limit", "set_receive_cache_limits", "receive_cache_statistics", "shared_memory", "shared_memory_statistics",
           "set_shared_memory_limit", "set_shared_memory_limits", "release_shared_memory",
           "close_same_host_channels", "built_with_torch"]

# The torch the extension was compiled against (None: a source tree that setup.py did not build).
built_with_torch = _extension.BUILT_WITH_TORCH

try:
    __version__ = _version("spbcast")  # python/pyproject.toml's, as installed
except _PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
