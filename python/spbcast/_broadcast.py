import datetime
import re

import torch
import torch.distributed as dist

from . import _C, _wire
from .errors import Error, RemoteError


def _group_and_root(group, src):
    if not dist.is_available() or not dist.is_initialized():
        raise Error("spbcast: torch.distributed is not initialized; call "
                    "torch.distributed.init_process_group first", "invalid_argument")
    pg = dist.group.WORLD if group is None else group
    rank = dist.get_rank(pg)
    if rank < 0:
        raise Error(f"spbcast: rank {dist.get_rank()} is not a member of the group it passed to "
                    "spbcast.broadcast; call it only on the group's ranks", "invalid_argument")
    try:
        pg._get_backend(torch.device("cpu"))
    except (RuntimeError, AttributeError) as e:
        raise Error(f"spbcast: rank {dist.get_rank()}: the group has no CPU backend (spbcast sends "
                    "CPU tensors); create the SP group with backend=\"gloo\" (or initialize with "
                    f"backend=\"cpu:gloo,cuda:nccl\"): {e}", "invalid_argument") from e
    ranks = dist.get_process_group_ranks(pg)
    if src not in ranks:
        raise Error(f"spbcast: rank {dist.get_rank()}: src={src} is not a rank of the group (its "
                    f"global ranks: {ranks}); src is a global rank, as in torch.distributed",
                    "invalid_argument")
    return pg, rank, dist.get_group_rank(pg, src)


_RANK_IN_MESSAGE = re.compile(r"\b(rank|root) (\d+)\b")


def _in_global_ranks(error, pg):
    """The core names the ranks of the group it is given (its group ranks: "spbcast: rank 1:
    broadcast #1 from root 0"); from Python every rank is named by its global rank, as src= is.
    The same exception with the group's global ranks in its message (and, for RemoteError, in
    root_rank and root_message); unchanged on a group whose ranks are 0..n-1."""
    ranks = dist.get_process_group_ranks(pg)
    if ranks == list(range(len(ranks))):
        return error
    sub = lambda text: _RANK_IN_MESSAGE.sub(  # noqa: E731
        lambda m: f"{m[1]} {ranks[int(m[2])]}" if int(m[2]) < len(ranks) else m[0], text)
    cls, args = error.__reduce__()[:2]
    args = [sub(args[0])] + list(args[1:])
    if isinstance(error, RemoteError):
        if 0 <= args[2] < len(ranks):
            args[2] = ranks[args[2]]
        args[3] = sub(args[3])
    return cls(*args)


def _core_broadcast(pg, *args):
    try:
        return _C.broadcast(pg, *args)
    except Error as e:
        raise _in_global_ranks(e, pg).with_traceback(e.__traceback__) from None


def _seconds(value, name="timeout", zero_is_unset=False):
    """Seconds as a float from a number or a timedelta; None (and 0 where zero_is_unset) gives
    None: the C++ default."""
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, datetime.timedelta) else value
    if zero_is_unset and type(seconds) in (int, float) and seconds == 0:
        return None
    if type(seconds) not in (int, float) or not 0 < seconds <= 1e9:
        raise Error(f"spbcast: {name} must be a positive number of seconds or a timedelta"
                    f"{' (or 0: as long as timeout)' if zero_is_unset else ''} (got {value!r})",
                    "invalid_argument")
    return float(seconds)


def _group_timeout(group):
    """Seconds the group's own collectives wait for a late peer (the ``timeout=`` its
    ``init_process_group`` or ``new_group`` was given): how long a BASE rank would wait for a
    late leader in the trainer's next collective on it. The one place spbcast reads it: the CPU
    backend's ``options._timeout`` (torch-internal; the suite runs it on torch 2.9 and 2.13).
    Where a backend has none, torch's own default for new groups (30 minutes)."""
    pg = dist.group.WORLD if group is None else group
    try:
        timeout = pg._get_backend(torch.device("cpu")).options._timeout
        return float(timeout.total_seconds())
    except (AttributeError, RuntimeError, TypeError):
        return float(dist.default_pg_timeout.total_seconds())


_TRANSPORTS = ("auto", "network", "shared_memory", "hierarchical")


def _check_transport(transport):
    if transport not in _TRANSPORTS:
        raise ValueError(f"spbcast: transport must be 'auto', 'network', 'shared_memory' or 'hierarchical', "
                         f"not {transport!r}")


def _relay_chunk_bytes(value, where="spbcast: "):
    """options.relay_chunk_bytes from a positive int; None keeps the C++ default (4 MiB). The
    core clamps it to 64 KiB .. 1 GiB; a larger int is capped here so that it fits a size_t."""
    if value is None:
        return None
    if type(value) is not int or value <= 0:
        raise ValueError(where + f"relay_chunk_bytes must be a positive int of bytes (got {value!r})")
    return min(value, _C.MAX_RELAY_CHUNK_BYTES)


def _keep_alive(group, src, *, timeout=None, transport="auto"):
    """A context manager: while it is open on ``src``, a C++ thread sends the followers a
    keep-alive frame every ``timeout / 4``, so followers already waiting in the next broadcast
    (with the same ``timeout``) do not time out while the root is slow to produce its value
    (C++ ``spbcast::detail::keep_alive``, as ``leader_loader`` uses it). It does nothing on the
    other ranks. Use it only where every follower is in, or about to enter, the next broadcast
    on ``group`` with no other collective on that group in between: each keep-alive frame is a
    collective that the followers' broadcast consumes."""
    _check_transport(transport)
    pg, _, root = _group_and_root(group, src)
    return _C.KeepAlive(pg, pg.group_name, root, _seconds(timeout), False, transport)


def _same_host_path(group, src):
    """Whether broadcasts from ``src`` on ``group`` take the same-host path on this rank: True or
    False once the first broadcast that may use it decided, None before."""
    pg, _, root = _group_and_root(group, src)
    return _C.same_host_path(pg, pg.group_name, root, False)


def _relay_hosts(group, src):
    """The hosts broadcasts from ``src`` on ``group`` relay to on the hierarchical path, the
    root's first, each as ``(host leader, [its other ranks])`` in global ranks; None where this
    rank does not relay (not decided yet, one host, or the network path)."""
    pg, _, root = _group_and_root(group, src)
    hosts = _C.relay_hosts(pg, pg.group_name, root, False)
    if hosts is None:
        return None
    ranks = dist.get_process_group_ranks(pg)
    return [(ranks[leader], [ranks[m] for m in members]) for leader, members in hosts]


def broadcast(obj, group=None, src=0, *, timeout=None, root_wait=None, checksum=False,
              transport="auto", relay_chunk_bytes=None, _use_registry=False, _name="batch",
              _decode=True):
    """Sends ``obj`` from the global rank ``src`` to every rank of ``group`` and returns it.

    On ``src`` the very object passed is returned; on every other rank an identical copy on the
    CPU: tensors bit for bit with their dtype, shape, strides and ``requires_grad``, a tensor
    referenced twice as one tensor referenced twice, views of one storage as views of one storage.
    Other ranks pass anything (``None``). Every rank of the group must call it.

    group: a torch.distributed group (default: the default group). src: a global rank.
    timeout: seconds (or a ``datetime.timedelta``) bounding every wait; default 5 minutes.
    root_wait: seconds (or a ``timedelta``) a follower waits for the root to start the broadcast
    (its first message); 0 or None means ``timeout``. A root that is only slow to produce its
    value (a big batch, a checkpoint saved on the leader) is not a transport failure: raise
    this, not ``timeout`` (C++ ``options.root_wait``).
    checksum: verify the payload with a checksum per transfer slot.
    transport: "auto" (shared memory where the whole group shares a host, the hierarchical path
    where it spans hosts, except one rank on each of two hosts, else the network), "network",
    "shared_memory" or "hierarchical" (docs/transports.md).
    relay_chunk_bytes: on the hierarchical path the payload moves from host leader to host
    leader in chunks of this many bytes, each forwarded as it lands, and every wait covers one
    chunk: smaller chunks fill the chain sooner and bound each wait tighter, larger ones cost
    fewer messages. A positive int; None: 4 MiB. The root's value is used, clamped to
    64 KiB .. 1 GiB (C++ ``options.relay_chunk_bytes``).

    Raises spbcast.Error (``.code`` says why) on every rank when the value cannot be sent
    (followers raise spbcast.RemoteError with the root's message); the group stays usable. A
    follower that will not rebuild what the root sent (a class the program did not allow with
    spbcast.allow_classes / allow_modules) raises spbcast.SchemaError alone, after the transfer.
    """
    _check_transport(transport)
    chunk = _relay_chunk_bytes(relay_chunk_bytes)
    pg, rank, root = _group_and_root(group, src)
    seconds = _seconds(timeout)
    wait = _seconds(root_wait, "root_wait", zero_is_unset=True)  # 0: as long as timeout
    name = pg.group_name
    if rank == root:
        me = dist.get_rank()
        try:
            wire = _C.to_wire(_wire.encode(obj, me, _name))
        except Exception as e:  # noqa: BLE001 - whatever failed, the followers must hear of it
            # Followers are already waiting in the core's first collective: send them the error
            # instead of the value, so they raise it at once and the group stays in step.
            error = e if isinstance(e, Error) else Error(
                f"spbcast: rank {me}: cannot send {_name}: reading it raised "
                f"{type(e).__name__}: {e}", "unsupported_value")
            _core_broadcast(pg, name, _C.to_wire(_wire.error_envelope(error)), root, seconds,
                         checksum, _use_registry, transport, wait, chunk)
            if error is e:
                raise
            raise error from e
        _core_broadcast(pg, name, wire, root, seconds, checksum, _use_registry, transport, wait, chunk)
        return obj
    envelope = _core_broadcast(pg, name, None, root, seconds, checksum, _use_registry, transport, wait, chunk)
    if not _decode:  # the caller decodes the body (in wire form) itself: LeaderLoader's steps
        return _wire.open_envelope(envelope, dist.get_rank(), src)
    return _wire.decode(envelope, dist.get_rank(), src, _name)
