"""The step exchange: the envelope one step sends from the SP leader to every SP rank - its error
(described as data, never the exception object), the epoch and step, the default generator words
the leader's loader drew, whether the data (or the pass) is done, the batch, the leader's seconds
in its loader and the envelope's kind ("step": fetched when next() asked; "prefetched"; "marker":
a prefetched fetch found the pass ended; "stop": the leader closed) - and how refusals and errors
travel: a batch the leader cannot send is followed by the same envelope without it, so every rank
still takes the step's draws and counters; an error reaches every SP rank with its code."""

import contextlib

from .._broadcast import _relay_hosts, _same_host_path, broadcast
from .._shared_memory import shared_memory
from .._wire import decode_body
from ..errors import Error, LoaderError, RemoteError, TransportError, loader_error, type_name

_ENVELOPE_KEYS = {"error", "epoch", "step", "words", "done", "batch", "seconds", "kind"}


def envelope(kind, epoch=-1, step=-1):
    """An envelope with nothing in it yet (its keys in the order they travel)."""
    return {"error": None, "epoch": epoch, "step": step, "words": 0, "done": False, "batch": None,
            "seconds": 0.0, "kind": kind}


def describe(error):
    """An exception as the leader sends it - data, never the exception object: spbcast's code
    for it (``loader`` for the loader's own exception), the type and message of the loader's
    exception, and the text every rank's message ends with."""
    if isinstance(error, LoaderError):
        return {"code": error.code, "type": error.original_type,
                "original": _text(error.original_message), "text": _text(error)}
    if isinstance(error, Error):
        return {"code": error.code, "type": type_name(type(error)), "original": _text(error),
                "text": _text(error)}
    name = type_name(type(error))
    return {"code": "loader", "type": name, "original": _text(error), "text": f"{name}: {_text(error)}"}


def _text(value):
    """str(value) as a plain str: an exception's message may be a str subclass (a DataLoader
    worker's KeyError carries torch's KeyErrorMessage), which spbcast would refuse to send."""
    return str.__str__(str(value))


def _is_description(error):
    return error is None or (type(error) is dict and set(error) == {"code", "type", "original", "text"}
                             and all(type(v) is str for v in error.values()))


def receive_step(group, leader, options, name):
    """A follower's side of StepExchange.send: the envelope in wire form, and the leader's
    refusal (a RemoteError) when its batch was refused and the batch-less envelope followed."""
    try:
        return broadcast(None, group, leader, _name=name, _decode=False, **options), None
    except TransportError:
        raise
    except RemoteError as refused:  # the leader refused its batch; its step follows
        return broadcast(None, group, leader, _name=name + " (refused)", _decode=False, **options), refused


class StepExchange:
    """The SP group's broadcasts of one LeaderLoader: ``group`` (the SP group) and ``leader``
    (its global rank 0); ``options`` the broadcasts' (timeout, root_wait, transport,
    relay_chunk_bytes). A ``channel`` argument is the prefetch's group, or None."""

    def __init__(self, group, leader, *, rank, is_leader, where, options, allocate_in_shared_memory):
        self.group, self.leader, self.options = group, leader, options
        self._rank, self._is_leader, self._where = rank, is_leader, where
        self._allocate_in_shared_memory = allocate_in_shared_memory

    def broadcast(self, value, name):
        """A collective of its own over the SP group (the loader's init, load_state_dict)."""
        return broadcast(value, self.group, self.leader, _name=name, **self.options)

    def loader_init(self, build):
        """The first broadcast: on the leader ``build(init)`` fills in the loader's length, the
        words building it drew and the prefetch depth, and returns what stays on the leader;
        every rank gets ``(init, that)``, or raises what building raised."""
        init = {"error": None, "words": 0, "length": -1, "prefetch": 0, "prefetch_reason": ""}
        failure, kept = None, None  # the leader's own exception, the cause of what every rank raises
        if self._is_leader:
            try:
                kept = build(init)
            except Exception as e:  # noqa: BLE001 - sent to the followers, re-raised below
                failure = e
                init["error"] = describe(e)
        init = self.broadcast(init, "loader_init")
        if init["error"] is not None:
            raise self.leader_failed("building the data loader", init["error"], failure)
        return init, kept

    def send(self, envelope, group, name=None):
        """The step's envelope on every rank (the leader's own; on followers the body with the
        batch still in wire form, its metadata checked), and on the leader the refusal if its
        batch was refused. A batch the root refuses (spbcast cannot send it) is followed by the
        same envelope without the batch, with the refusal as its error: the step's draws and
        counters reach every rank. A refused batch counts as a step (the loader produced it): a
        trainer that skips it goes on at the same step everywhere."""
        name = name or (f"step[{envelope['step']}]" if envelope is not None else "the next step")
        if not self._is_leader:
            received, refused = receive_step(group, self.leader, self.options, name)
            return self.checked(received), refused
        try:
            broadcast(envelope, group, self.leader, _name=name, **self.options)
            return envelope, None
        except (TransportError, RemoteError):
            raise
        except Error as refused:  # the batch refused by spbcast (followers got RemoteError)
            envelope = dict(envelope, batch=None, done=False, error=describe(refused))
            broadcast(envelope, group, self.leader, _name=name + " (refused)", **self.options)
            return envelope, refused

    def checked(self, body):
        if type(body) is dict and body.get("error") is not None:  # still in wire form
            body["error"] = decode_body(body["error"], self._rank, f"step[{body.get('step')}][\"error\"]")
        if type(body) is dict and set(body) == {"error", "warning"}:
            raise Error(self._where + f": the SP leader (rank {self.leader}) is in load_state_dict "
                        "while this rank fetches a step: call load_state_dict on every SP rank "
                        "(followers may pass None)", "out_of_step")
        if not (type(body) is dict and set(body) == _ENVELOPE_KEYS
                and type(body["seconds"]) is float
                and body["kind"] in ("step", "prefetched", "marker", "stop")
                and _is_description(body["error"])
                and type(body["epoch"]) is int and type(body["step"]) is int
                and type(body["done"]) is bool):
            raise Error(self._where + f": the SP leader (rank {self.leader}) sent a step that is "
                        "not a LeaderLoader envelope (is the same spbcast installed on every rank?)",
                        "corrupt_frame")
        return body

    def batch(self, received, step):
        """The step's batch on this rank: a follower decodes it from its wire form."""
        if not self._is_leader and not received["done"]:
            return decode_body(received["batch"], self._rank, f'step[{step}]["batch"]')
        return received["batch"]

    def checked_load_outcome(self, outcome):
        if not (type(outcome) is dict and set(outcome) == {"error", "warning"}
                and _is_description(outcome["error"]) and type(outcome["warning"]) in (str, type(None))):
            raise Error(self._where + f": the SP leader (rank {self.leader}) sent a load_state_dict "
                        "outcome that is not LeaderLoader's (is the same spbcast installed on every "
                        "rank?)", "corrupt_frame")
        return outcome

    def leader_failed(self, doing, error, cause=None):
        """What every SP rank raises when the leader failed ``doing``: ``error`` is the leader's
        describe() of it. The loader's own exception becomes a LoaderError that is also of its
        type where it can be (on the leader, any type, chained to the exception itself); a
        refusal by spbcast keeps its code."""
        message = self._where + f": the SP leader (rank {self.leader}) failed {doing}: {error['text']}"
        if error["code"] != "loader":
            raise_as = Error(message, error["code"])
        else:
            original = cause.__cause__ if isinstance(cause, LoaderError) else cause
            raise_as = loader_error(message, error["type"], error["original"],
                                    type(original) if original is not None else None)
        raise_as.__cause__ = cause
        return raise_as

    def fetching_in_shared_memory(self, channel):
        """On the same-host path a batch collated inside is born in shared memory, so the
        broadcast copies nothing."""
        return shared_memory() if self._batches_in_shared_memory(channel) else contextlib.nullcontext()

    def _batches_in_shared_memory(self, channel):
        # As detail/loader/step_exchange.hpp's batches_in_shared_memory(): only when the (group,
        # leader) takes the same-host path, which the first broadcast (loader_init) decided, and
        # the switch is on.
        if not self._allocate_in_shared_memory or self.options["transport"] == "network":
            return False
        return self._same_host_path(channel)

    def path(self, channel, dedup):
        """How batches travel (stats()'s ``path``)."""
        if not dedup:
            return "local"
        if self.options["transport"] == "network":  # the group's same-host state is for other broadcasts
            return "network"
        # A group over several hosts keeps a same-host state too (each host's own ranks): the
        # relay says which it is.
        if _relay_hosts(self._steps_group(channel), self.leader):
            return "hierarchical"
        return "same_host" if self._same_host_path(channel) else "network"

    def _same_host_path(self, channel):
        return _same_host_path(self._steps_group(channel), self.leader) is True

    def _steps_group(self, channel):
        # The group the steps travel on: with prefetch the channel, once its first broadcast
        # decided its path (the SP group's loader_init decided the same for the same ranks).
        if channel is not None and _same_host_path(channel, self.leader) is not None:
            return channel
        return self.group
