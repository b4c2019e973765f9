"""The launcher side of the dead-peer tests (test_peer_death.py, and each drop-in's own test file:
test_energon.py, test_swift.py, test_xtuner_trainer.py): starts the ranks of one job - spawned
(``peer_death_ranks.py``) or forked from the test's process, which imported a trainer once -
waits until the rank that ends itself did (its ``victim.json``) and every other rank exited, and
checks that nothing of the job is left. The ranks' side (how a rank ends itself and records what
it raised) is peer_death_ranks.py.

The dead rank is reaped only after the survivors ended, so the kernel still tells its signal."""

import json
import os
import signal
import socket
import sys
import tempfile
import time
import traceback

import peer_death_ranks

HERE = os.path.dirname(os.path.abspath(__file__))


class ForkedRank:
    """A rank forked from this process, in a session of its own; what the launcher needs of a
    ``subprocess.Popen``."""

    def __init__(self, rank, fn, out):
        self.returncode = None
        self.pid = os.fork()
        if self.pid == 0:
            code = 0
            try:
                os.setsid()
                fn(rank, out)
            except BaseException:  # noqa: BLE001 - the test reads it from the rank's error file
                with open(os.path.join(out, f"error-rank{rank}.txt"), "w") as f:
                    f.write(traceback.format_exc())
                code = 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)

    def poll(self):
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def kill(self):
        os.kill(self.pid, signal.SIGKILL)

    def wait(self):
        if self.returncode is None:
            self.returncode = os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
        return self.returncode


def run(start, world, timeout=120):
    """start(rank, out) -> the rank's process (a Popen or a ForkedRank), for every rank of the job.
    Returns (victim, records, ended, ranks): the victim's ``victim.json``, each survivor's
    ``rank<r>.json``, {survivor: (when it exited on CLOCK_MONOTONIC, its exit code)}, the
    processes. Every process of the job is gone when it returns."""
    with tempfile.TemporaryDirectory() as out:
        ranks = []
        try:
            for r in range(world):
                ranks.append(start(r, out))
            ended, victim = {}, None
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if victim is None and os.path.exists(os.path.join(out, "victim.json")):
                    with open(os.path.join(out, "victim.json")) as f:
                        victim = json.load(f)
                # Survivors only: the victim stays a zombie, so its exit status can be read.
                for r, p in enumerate(ranks):
                    if r not in ended and (victim is None or p.pid != victim["pid"]):
                        if p.poll() is not None:
                            ended[r] = (time.monotonic(), p.returncode)
                if victim is not None and len(ended) == world - 1:
                    break
                if victim is None and len(ended) == world:
                    raise AssertionError(f"every rank ended before the kill: {ended}{_errors(out)}")
                time.sleep(0.005)
            else:
                raise AssertionError(f"the ranks did not end within {timeout} s (ended: {sorted(ended)})")
            records = {}
            for r in ended:
                path = os.path.join(out, f"rank{r}.json")
                assert os.path.exists(path), f"rank {r} exited ({ended[r][1]}) with no record{_errors(out)}"
                with open(path) as f:
                    records[r] = json.load(f)
            return victim, records, ended, ranks
        finally:
            for p in ranks:
                if p.poll() is None:
                    try:
                        os.kill(p.pid, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
                    p.kill()
                p.wait()
            no_process_left(ranks)


def fork(fn, world, timeout=120):
    """run() with the ranks forked from this process: each runs fn(rank, out)."""
    return run(lambda r, out: ForkedRank(r, fn, out), world, timeout)


def _errors(out):
    texts = [open(os.path.join(out, name)).read() for name in sorted(os.listdir(out)) if name.startswith("error-")]
    return "".join("\n" + t for t in texts)


def no_process_left(ranks, wait=15):
    """Every process of the ranks' sessions (the dead leader's DataLoader workers included) is
    gone - torch's worker watchdog ends a dead leader's workers within its 5 s period."""
    sessions = {p.pid for p in ranks}
    end = time.monotonic() + wait
    while True:
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and peer_death_ranks.proc_stat(pid, 3) in sessions]
        if not left:
            return
        assert time.monotonic() < end, f"processes left behind: {left}"
        time.sleep(0.1)


def assert_named(rank, record, ended, victim, dead, what):
    """The survivor ``rank`` raised spbcast's TransportError naming the dead rank ``dead`` (this
    host, its pid, SIGKILL) within 1 s of the kill, and exited within 1 s after it; the two times
    are printed."""
    assert record["error"] is not None, f"{what}: rank {rank} ended its loop without an error"
    assert record["type"] == "TransportError" and record["code"] == "transport", (what, rank, record)
    named = (f"rank {dead} (RANK={dead}, host {socket.gethostname()}, pid {victim['pid']}) exited: "
             f"killed by signal 9 (SIGKILL)")
    assert named in record["error"], (what, rank, record["error"])
    detected, exited = record["at"] - victim["at"], ended[rank][0] - record["at"]
    assert 0 <= detected < 1.0, f"{what}: rank {rank} raised {detected:.3f} s after the kill: {record['error']}"
    assert exited < 1.0, f"{what}: rank {rank} took {exited:.3f} s to exit after its error"
    print(f"{what}: rank {rank} raised {detected * 1000:.0f} ms after the kill, exited {exited * 1000:.0f} ms later")
