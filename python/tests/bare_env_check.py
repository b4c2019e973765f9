"""Runs spbcast where a user who installed only the package has it: an environment holding torch,
the package and its declared requirements, nothing else (test_install.py makes one with pip and
runs this there). Every import the package makes on these paths must be satisfied by what it
declares; an undeclared one (numpy, say) fails here.

On 2 real Gloo ranks: a broadcast of a mixed batch, and LeaderLoader over shuffled DataLoaders on
the default generator (in process and with workers) whose batches and default generators on every
rank equal BASE's - the same DataLoader iterated by each rank itself.
    python bare_env_check.py        exit 0 and print "bare environment: ok"
"""

import importlib.util
import sys

import torch
from torch.utils.data import DataLoader

from dist_harness import run

N = 10
EPOCHS = 2


def loader(workers):
    kw = {"num_workers": workers}
    if workers:
        kw.update(multiprocessing_context="fork", persistent_workers=True)
    return DataLoader(list(range(N)), batch_size=3, shuffle=True, **kw)


def base(workers):
    """Each rank's own loader, as without spbcast: its batches and its default generator after."""
    torch.manual_seed(7)
    own = loader(workers)
    batches = [b for _ in range(EPOCHS) for b in own]
    return batches, torch.get_rng_state()


def rank_main(rank, world):
    import spbcast  # after the group exists: nothing at import time may need more than torch

    value = {"ids": torch.arange(6).view(2, 3)[:, 1:], "text": "é", "raw": b"\x00\xff",
             "nested": [(1, 2.5, None, True)], "empty": []}
    got = spbcast.broadcast(value if rank == 0 else None, src=0)
    assert got["text"] == "é" and got["raw"] == b"\x00\xff" and got["nested"] == [(1, 2.5, None, True)]
    assert torch.equal(got["ids"], value["ids"]) and got["ids"].stride() == value["ids"].stride()

    for workers in (0, 2):
        expected, generator_after = base(workers)
        torch.manual_seed(7)
        ll = spbcast.LeaderLoader(lambda: loader(workers), None, sp_media_dedup=True, total_epoch=EPOCHS)
        batches = list(ll)
        assert len(batches) == len(expected), (rank, workers, len(batches))
        for got_batch, want in zip(batches, expected):
            assert torch.equal(got_batch, want), (rank, workers, got_batch, want)
        assert torch.equal(torch.get_rng_state(), generator_after), (rank, workers, "default generator")
        assert ll.stats()["built_with_torch"] == spbcast.built_with_torch == str(torch.__version__)


def main():
    # The environment must really be bare, or this proves nothing.
    present = [m for m in ("numpy", "PIL", "transformers", "accelerate", "pytest") if importlib.util.find_spec(m)]
    if present:
        sys.exit(f"bare_env_check: the environment holds {present}; run it where only torch and spbcast are")
    run(2, rank_main)
    print("bare environment: ok")


if __name__ == "__main__":
    main()
