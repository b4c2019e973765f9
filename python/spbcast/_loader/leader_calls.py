"""The calls into the loader and the default generator words each draws (observed around the
call, see generators.py), so followers consume exactly as many. The trainer's calls into the
loader between steps (set_epoch, load_state_dict) are deferred to the dedup leader's next fetch,
inside the step: a slow one is covered by keep-alive frames, a failing one reaches every SP
rank, and the words it draws travel with that step."""

from .generators import counted, drawn, mirror
from ..errors import Error, loader_error, type_name


class LeaderCalls:
    """The dedup leader's calls into its loader made outside a step, run at its next fetch, and
    the generator words drawn outside a step, sent with the next one. Without dedup a call runs
    at once and nothing is counted."""

    def __init__(self, where, dedup):
        self._where, self._dedup = where, dedup
        self.pending = []
        self.carried_words = 0

    def due(self):
        """Whether something must run or be sent on the trainer's thread before the next fetch."""
        return bool(self.pending or self.carried_words)

    def take_carried_words(self):
        """The words drawn outside the steps, now sent with a step."""
        words, self.carried_words = self.carried_words, 0
        return words

    # ---- the words mirror -----------------------------------------------------------------------

    def counted(self, words, doing, fn, *args):
        return counted(self._where, words, doing, fn, *args)

    def words(self, before, doing):
        return drawn(self._where, before, doing)

    def mirror(self, words, leader):
        mirror(self._where, words, leader)

    # ---- the leader's work outside the steps ----------------------------------------------------

    def leader_work(self, doing, work):
        """work(words) on this rank's loader: at once without dedup; on the dedup leader at its
        next fetch, inside the step (see the module's docstring)."""
        if not self._dedup:
            work(None)
        else:
            self.pending.append((doing, work))

    def run_pending(self, words):
        pending, self.pending = self.pending, []
        for doing, work in pending:
            try:
                work(words)
            except Error:
                raise
            except Exception as e:  # noqa: BLE001 - named, then sent to the followers
                raise loader_error(f"{doing} raised {type_name(type(e))}: {e}", type_name(type(e)), str(e),
                                   type(e)) from e

    def run_pending_outside_step(self):
        # state_dict() must see what set_epoch / load_state_dict asked for; run on the leader
        # alone, outside any step, so no keep-alive (followers may be in another collective),
        # and the words they draw are sent with the next step.
        if self.pending:
            words = [0]
            try:
                self.run_pending(words)
            finally:  # a call that raised drew its words too
                self.carried_words += words[0]

    def outside_step(self, doing, fn):
        words = None if not self._dedup else [0]
        out = self.counted(words, doing, fn)
        if words is not None:
            self.carried_words += words[0]
        return out

    def drop_pending(self):
        self.pending = []
