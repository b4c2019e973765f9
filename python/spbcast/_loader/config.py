"""The configuration checks of LeaderLoader, made on every rank before any collective, so a bad
configuration is one clear error everywhere rather than a rank stuck in a collective."""

import torch.distributed as dist

from .._broadcast import _TRANSPORTS, _relay_chunk_bytes, _seconds
from ..errors import Error


def check(where, make_loader, *, sp_media_dedup, total_epoch, total_step, first_epoch, set_epoch,
          build_on_every_rank, state_hooks, tp_size, timeout, root_wait, transport, relay_chunk_bytes,
          prefetch, log_every):
    """Raises the first problem of a LeaderLoader's arguments; ``where`` begins each message."""
    _check_passes(where, total_epoch, total_step, first_epoch, set_epoch)
    if state_hooks is not None and not (isinstance(state_hooks, (tuple, list))
                                        and len(state_hooks) == 2
                                        and all(callable(h) for h in state_hooks)):
        raise Error(where + "state_hooks must be a pair of callables (save(loader) -> state, "
                    f"load(loader, state)) (got {state_hooks!r})", "invalid_argument")
    if type(tp_size) is not int or tp_size < 1:
        raise Error(where + f"tp_size must be an int of at least 1 (got {tp_size!r})",
                    "invalid_argument")
    if sp_media_dedup and tp_size > 1:
        raise Error(where + f"sp_media_dedup requires TP size 1 (got {tp_size}); turn "
                    "sp_media_dedup off or run with tensor parallelism 1", "invalid_argument")
    if not callable(make_loader):
        raise Error(where + "make_loader must be a callable that returns the loader",
                    "invalid_argument")
    if build_on_every_rank is not None and not callable(build_on_every_rank):
        raise Error(where + "build_on_every_rank must be a callable (its result is passed to "
                    "make_loader)", "invalid_argument")
    _check_transport(where, timeout, root_wait, transport, relay_chunk_bytes)
    if prefetch is not None and (type(prefetch) is not int or prefetch < 0):
        raise Error(where + f"prefetch must be None (where it keeps every rank's batches and "
                    f"generators BASE's) or an int of at least 0 (got {prefetch!r})",
                    "invalid_argument")
    if type(log_every) is not int or log_every < 0:
        raise Error(where + f"log_every must be an int of at least 0 (got {log_every!r})",
                    "invalid_argument")
    if sp_media_dedup and not dist.is_initialized():
        raise Error(where + "sp_media_dedup needs torch.distributed to be initialized",
                    "invalid_argument")


def _check_passes(where, total_epoch, total_step, first_epoch, set_epoch):
    if set_epoch is None:
        if total_epoch is not None or total_step is not None:
            raise Error(where + "with set_epoch=None the host trainer drives the passes (each "
                        "iter() is one pass of the loader): leave total_epoch and total_step "
                        "unset", "invalid_argument")
    elif (total_epoch is None) == (total_step is None):
        raise Error(where + "set exactly one of total_epoch and total_step "
                    f"(both are {'set' if total_epoch is not None else 'unset'}), or "
                    "set_epoch=None for one pass per iter()", "invalid_argument")
    for name, v in (("total_epoch", total_epoch), ("total_step", total_step)):
        if v is not None and (type(v) is not int or v <= 0):
            raise Error(where + f"{name} must be a positive int (got {v!r})", "invalid_argument")
    if type(first_epoch) is not int:
        raise Error(where + f"first_epoch must be an int (got {first_epoch!r})", "invalid_argument")
    if not (set_epoch is None or set_epoch == "auto" or callable(set_epoch)):
        raise Error(where + "set_epoch must be \"auto\", None (the trainer calls set_epoch) or "
                    f"a callable mapping the pass index to the epoch (got {set_epoch!r})",
                    "invalid_argument")


def _check_transport(where, timeout, root_wait, transport, relay_chunk_bytes):
    if transport not in _TRANSPORTS:
        raise Error(where + "transport must be 'auto', 'network', 'shared_memory' or 'hierarchical' "
                    f"(got {transport!r})", "invalid_argument")
    _seconds(timeout)  # refused here, on every rank, rather than in the first broadcast
    _seconds(root_wait, "root_wait")
    _relay_chunk_bytes(relay_chunk_bytes, where)
