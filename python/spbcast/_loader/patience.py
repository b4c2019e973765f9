"""Patience: how long a rank of the leader loader waits for a peer. A leader still building its
loader or fetching a batch sends keep-alive frames (every quarter of the shorter of ``timeout``
and ``root_wait``), so the followers wait for it as a BASE rank waits for its own loader; a peer
busy outside the loader (a checkpoint, an evaluation) gets ``root_wait``, the SP group's own
timeout unless the caller says otherwise."""

from .._broadcast import _group_timeout, _keep_alive, _seconds

_DEFAULT_TIMEOUT = 300.0  # seconds: the core's options.timeout, which timeout=None keeps


class Patience:
    def __init__(self, group, leader, *, timeout, root_wait, transport, dedup):
        self._leader, self._timeout, self._transport = leader, timeout, transport
        # A step's first message waits for a late peer as long as the group's own collectives
        # would (as C++ loader_config::root_wait).
        self.root_wait = None
        if dedup:
            self.root_wait = _seconds(root_wait, "root_wait") or _group_timeout(group)

    def still_working(self, group):
        """Keep-alive frames on ``group`` while the leader works. Only around the leader's work
        inside the step protocol (building the loader, fetching a batch), where every follower
        is already waiting in the broadcast that follows, as in C++ leader_loader - on the
        group the steps travel on. state_dict()/load_state_dict() run outside it: the followers
        may be in another collective then, which a keep-alive frame would put out of step."""
        return _keep_alive(group, self._leader, timeout=self._timeout, transport=self._transport)

    def closing_wait(self):
        """Seconds close() waits for the prefetch's last jobs and its thread."""
        return _seconds(self._timeout) or _DEFAULT_TIMEOUT
