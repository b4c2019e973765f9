"""The torch generators a loader's order draws from: the default CPU generator's advance counted
in 32-bit words (the mirror's arithmetic: what the leader observes and the followers replay, as
C++ rng_mirror.hpp), the generators a pass starts from (captured in a state, set again to replay
a pass), and what of a DataLoader decides whether a pass can be replayed from them."""

import contextlib

import torch
import torch.utils.data.distributed

from ..errors import Error

_MT_N = 624  # words per Mersenne Twister block
# The largest advance one loader call may make (64 Mi words: 256 MiB of random floats). An
# advance is counted by stepping a copy of the generator, which costs about as much as drawing
# the words did, and a change no advance explains is only known once the search passed this
# bound: it bounds what a cached normal sample or a reseed with the same seed costs before it
# is refused (another seed is seen at once: the state's initial seed changed).
MAX_WORDS_PER_CALL = 1 << 26
_REPLAY_CHUNK = 1 << 20
# The samplers whose pass order depends only on the generators a pass starts from (captured in
# the state) and the epoch given to set_epoch: a DataLoader with one of these resumes exactly
# without state of its own.
REPLAYABLE_SAMPLERS = (torch.utils.data.SequentialSampler, torch.utils.data.RandomSampler,
                       torch.utils.data.SubsetRandomSampler, torch.utils.data.WeightedRandomSampler,
                       torch.utils.data.distributed.DistributedSampler)


def advance(generator, words):
    """Consumes `words` 32-bit words of `generator` (None: the default CPU generator)."""
    while words > 0:
        n = min(words, _REPLAY_CHUNK)
        torch.empty(n, dtype=torch.int32).random_(generator=generator)  # one word an element
        words -= n


def _next_index(state):
    # CPUGeneratorImpl's serialized state (THGeneratorState, unchanged since LibTorch 1.x):
    # u64 initial seed, i32 left, i32 seeded, u64 next (the position in the block), ...
    # Read through tolist(), not numpy(): numpy is not a dependency of torch or of spbcast.
    return int.from_bytes(bytes(state[16:24].tolist()), "little")


def layout_known():
    """Whether _next_index reads this torch's state layout (checked once, on a scratch one)."""
    global _LAYOUT_KNOWN
    if _LAYOUT_KNOWN is None:
        g = torch.Generator().manual_seed(12345)
        before = g.get_state()
        advance(g, 700)
        after = g.get_state()
        _LAYOUT_KNOWN = (before.numel() >= 24 + 8 * _MT_N and
                         (_next_index(after) - _next_index(before)) % _MT_N == 700 % _MT_N)
    return _LAYOUT_KNOWN


_LAYOUT_KNOWN = None


def initial_seed(state):
    return bytes(state[0:8].tolist())


def count_words(before, after):
    """How many 32-bit words take the default CPU generator's state from before to after, or
    None when no advance of at most MAX_WORDS_PER_CALL words does."""
    if torch.equal(before, after):
        return 0
    if layout_known() and initial_seed(before) != initial_seed(after):
        return None  # reseeded (manual_seed with another seed): no advance explains it
    g = torch.Generator()
    g.set_state(before)
    if layout_known():
        # The position in the block fixes the count modulo one block; try block by block.
        total = (_next_index(after) - _next_index(before)) % _MT_N
        advance(g, total)
        step = _MT_N
    else:
        total, step = 0, 1
    while total <= MAX_WORDS_PER_CALL:
        if torch.equal(g.get_state(), after):
            return total
        advance(g, step)
        total += step
        if step == 1 and total > 4 * _MT_N:  # without the layout, only short advances
            break
    return None


def counted(where, words, doing, fn, *args):
    """fn(*args), adding the default generator words it draws to words[0] (None: dedup is
    off, nothing to count) - also when fn raises: in BASE a failing call draws as well.
    ``where`` begins a message."""
    if words is None:
        return fn(*args)
    before = torch.get_rng_state()
    try:
        out = fn(*args)
    except Exception as e:
        try:
            words[0] += drawn(where, before, doing)
        except Error as refused:
            raise Error(f"{refused} (after it raised {type(e).__name__}: {e})", "loader") from e
        raise
    words[0] += drawn(where, before, doing)
    return out


def drawn(where, before, doing):
    """The words from ``before`` (the default generator's state) to now, drawn ``doing``."""
    after = torch.get_rng_state()
    n = count_words(before, after)
    if n is None:
        if layout_known() and initial_seed(before) != initial_seed(after):
            what = "it reseeded it (torch.manual_seed or set_rng_state)"
        else:
            what = (f"no advance of at most {MAX_WORDS_PER_CALL:,} 32-bit words ("
                    f"{MAX_WORDS_PER_CALL * 4 / (1 << 20):g} MiB of random data) per call "
                    "explains it: the call drew more than that (spbcast counts the words by "
                    "stepping a copy of the generator, as long again as drawing them), "
                    "reseeded it with the same seed, or left a cached normal sample")
        raise Error(where + f": {doing} changed the default CPU generator in a way "
                    f"spbcast cannot mirror on the followers: {what}; give that code (e.g. a "
                    "large augmentation) a torch.Generator of its own, or move it into "
                    "DataLoader workers (num_workers > 0)", "loader")
    return n


def mirror(where, words, leader):
    """A follower: advances its default generator as the leader's loader advanced the
    leader's (``words``, from the leader's envelope)."""
    if type(words) is not int or not 0 <= words <= 1 << 40:
        raise Error(where + f": the SP leader (rank {leader}) sent an invalid "
                    f"generator advance {words!r}", "corrupt_frame")
    advance(None, words)


# torch-internal: where a DataLoader with persistent workers keeps their iterator between passes
# (torch 1.7 on; checked on torch 2.9 and 2.13). Where a torch has none, resuming such a loader
# warns.
_PERSISTENT_ITERATOR = "_iterator"


def _has_persistent_workers(loader):
    return (isinstance(loader, torch.utils.data.DataLoader) and loader.persistent_workers
            and loader.num_workers > 0)


def persistent_iterator(loader):
    """The iterator a DataLoader with persistent workers keeps between passes, or None. Its next
    iter() resets it: the workers go on, seeded as they were, and no base seed is drawn."""
    return getattr(loader, _PERSISTENT_ITERATOR, None) if _has_persistent_workers(loader) else None


def shut_down_workers(iterator):
    """Ends a DataLoader iterator's worker processes now (None: nothing). torch-internal, named
    here only: the iterator's _shutdown_workers(); where a torch has none, dropping the iterator
    ends them when it is collected."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if callable(shutdown):
        shutdown()


def keeps_workers(loader):
    """A DataLoader with persistent workers whose iterator spbcast can see on this torch."""
    return _has_persistent_workers(loader) and hasattr(loader, _PERSISTENT_ITERATOR)


def sampler_of(loader):
    """What orders a DataLoader's pass: its batch sampler's sampler, or a batch sampler of the
    program's own."""
    if type(loader.batch_sampler) is torch.utils.data.BatchSampler:
        return loader.batch_sampler.sampler
    return loader.batch_sampler if loader.batch_sampler is not None else loader.sampler


def replay_is_exact(loader):
    """Whether replaying a pass from its generators gives the continuous run's order: a
    DataLoader whose sampler is one of torch's own (else a sampler's order may depend on
    what spbcast cannot capture: Python's or numpy's generators, a dataset's own state)."""
    return isinstance(loader, torch.utils.data.DataLoader) and type(sampler_of(loader)) in REPLAYABLE_SAMPLERS


def _generators(loader):
    """The torch generators the loader's pass order may draw from, by name: the default CPU
    generator and those a DataLoader and its samplers were given."""
    found = {"default": None}
    for name, owner in (("loader", loader), ("sampler", getattr(loader, "sampler", None)),
                        ("batch_sampler.sampler",
                         getattr(getattr(loader, "batch_sampler", None), "sampler", None))):
        generator = getattr(owner, "generator", None)
        if isinstance(generator, torch.Generator) and generator.device.type == "cpu":
            found[name] = generator
    return found


def generator_states(loader):
    # As lists of byte values: a state a trainer may save with json as well as torch.save.
    return {name: (torch.get_rng_state() if g is None else g.get_state()).tolist()
            for name, g in _generators(loader).items()}


def set_generators(loader, states):
    """Sets the generators named in ``states`` (as generator_states wrote them); one the
    loader no longer has is skipped."""
    generators = _generators(loader)
    for name, state in states.items():
        state = torch.tensor(state, dtype=torch.uint8)
        if name == "default":
            torch.set_rng_state(state)
        elif name in generators:
            generators[name].set_state(state)


@contextlib.contextmanager
def borrowed_generators(loader):
    """Every generator the loader's order may draw from, given back as it was: what runs
    inside draws nothing that BASE drew (nothing to mirror either)."""
    states = generator_states(loader)
    try:
        yield
    finally:
        set_generators(loader, states)
