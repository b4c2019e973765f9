"""Which ranks' datasets read samples, for the trainers' harnesses (swift_ranks.py, verl_ranks.py):
the calls of a dataset's method counted in every process of a rank, DataLoader workers included
(they fork from it), and what a dedup arm's records must show."""

import os


class CallCounter:
    """Counts the calls of ``cls.name`` from ``start(path)`` until ``stop()``: each call appends
    its process's id to the file ``path`` (one per rank)."""

    def __init__(self, cls, name):
        self.path, self.on = None, False
        counted, counter = getattr(cls, name), self

        def counting(obj, *args, **kwargs):
            if counter.on:
                with open(counter.path, "a") as f:
                    f.write(f"{os.getpid()}\n")
            return counted(obj, *args, **kwargs)

        setattr(cls, name, counting)

    def start(self, path):
        if os.path.exists(path):
            os.remove(path)
        self.path, self.on = path, True

    def stop(self):
        self.on = False

    def count(self):
        """The calls since start(): in all, and in other processes than this one (its workers)."""
        if self.path is None or not os.path.exists(self.path):
            return 0, 0
        with open(self.path) as f:
            pids = f.read().split()
        return len(pids), sum(pid != str(os.getpid()) for pid in pids)


def assert_only_leaders(arm, records, leaders, followers, key, verb, workers):
    """A dedup arm's records (one per rank, each with ``key`` and ``key + "_in_workers"``: its
    CallCounter's counts): every SP leader ``verb`` samples - in its DataLoader workers only, with
    ``workers`` - and no follower did."""
    for rank in leaders:
        assert records[rank][key] > 0, f"{arm}: SP leader {rank} {verb} no sample"
        if workers:
            assert records[rank][f"{key}_in_workers"] == records[rank][key], (
                f"{arm}: SP leader {rank} {verb} in its main process, not in its DataLoader workers")
    for rank in followers:
        assert records[rank][key] == 0, f"{arm}: SP follower {rank} {verb} {records[rank][key]} samples"
