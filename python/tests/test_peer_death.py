"""A dead peer is named within a second, whatever holds its sockets (docs/errors.md).

Real processes (3 ranks, real Gloo, a LeaderLoader over a real DataLoader with 0, 2 or 2
persistent workers; the same-host path, and the network path with transport="network"), real
kills: a leader or a follower SIGKILLs itself mid-fetch, while large batches are in flight, or
between steps (peer_death_ranks.py). Every survivor must raise spbcast's error naming
the dead rank, its host and how it ended within 1 s of the kill - measured in the processes
themselves, on CLOCK_MONOTONIC - and close its loader, destroy its process group (which joins
the backend's threads) and exit within 1 s after it, leaving no process behind. A
leader that is only stopped (SIGSTOP) is not dead: its followers fail at root_wait, not sooner.
The launcher is peer_death.py; each drop-in's own kill test is in its test file (test_energon.py,
test_swift.py, test_xtuner_trainer.py), which runs in the drop-in's environment."""

import os
import signal
import subprocess
import sys

import pytest

import peer_death

WORLD = 3


def _run(case, workers, world=WORLD, hosts=None):
    """hosts: [(namespace, device)] - rank r runs in hosts[r // 2] (ip netns exec)."""
    env = dict(os.environ, PYTHONPATH=peer_death.HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))

    def start(r, out):
        cmd = [sys.executable, os.path.join(peer_death.HERE, "peer_death_ranks.py"), str(r), str(world), out,
               case, workers]
        if not hosts:
            return subprocess.Popen(cmd, env=env, start_new_session=True)
        ns, dev = hosts[r // 2]
        return subprocess.Popen(["ip", "netns", "exec", ns] + cmd, env=dict(env, GLOO_SOCKET_IFNAME=dev),
                                start_new_session=True)

    return peer_death.run(start, world)


from test_hosts import two_hosts  # noqa: E402,F401 - the fixture: two network namespaces

CASES = [("leader-fetch", "2"), ("leader-fetch", "2p"), ("leader-fetch", "0"),
         ("leader-broadcast", "2"), ("leader-between", "2"), ("leader-between", "2p"),
         ("leader-between", "0"), ("follower-broadcast", "2"), ("follower-between", "2"),
         ("follower-between", "0"),
         ("network-leader-between", "2"), ("network-follower-between", "2")]


@pytest.mark.parametrize("case,workers", CASES, ids=[f"{c}-{w}w" for c, w in CASES])
def test_survivors_name_the_dead_rank_within_a_second(case, workers):
    victim, records, ended, ranks = _run(case, workers)
    dead = 1 if "follower" in case else 0
    assert victim["pid"] == ranks[dead].pid
    for r, rec in records.items():
        peer_death.assert_named(r, rec, ended, victim, dead, f"{case} workers={workers}")
        assert ended[r][1] == 0 and rec["children"] == [], (ended[r], rec["children"])


@pytest.mark.parametrize("workers", ["2", "0"])
def test_a_stopped_leader_is_waited_for(workers):
    victim, records, ended, ranks = _run("leader-stopped", workers)
    assert victim["signal"] == signal.SIGSTOP
    for r, rec in records.items():
        assert rec["type"] == "TransportError" and rec["code"] == "timeout", rec
        waited = rec["at"] - victim["at"]
        # Its wait for the step may have begun a moment before the leader stopped itself.
        assert waited >= 3.0 - 0.25, f"rank {r} gave up on a stopped leader after {waited:.3f} s, before root_wait"
        assert "exited" not in rec["error"], rec["error"]
        exited = ended[r][0] - rec["at"]
        assert exited < 1.0, f"rank {r} took {exited:.3f} s to exit after its error"


def test_the_trainer_drop_in_names_a_dead_tp_leader():
    """transformers' real Trainer under spbcast.accelerate.enable, 4 ranks on the (dp_shard 2,
    tp 2) mesh, 2 DataLoader workers: the TP leader rank 0 is killed at the end of an optimizer
    step; its follower rank 1 raises spbcast's error naming it within 1 s and exits within 1 s.
    Ranks 2 and 3 (the other TP pair) fail in the gradients' all-reduce, the backend's error;
    they only have to end."""
    pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup.sh installs accelerate==1.15.0)")
    pytest.importorskip("transformers", reason="transformers is not installed (scripts/setup.sh installs it)")
    victim, records, ended, ranks = _run("trainer-leader", "2", world=4)
    assert victim["pid"] == ranks[0].pid
    peer_death.assert_named(1, records[1], ended, victim, 0, "Trainer")
    for r in (2, 3):
        assert records[r]["error"] is not None, f"rank {r} finished training without its DP peer"


def test_a_dead_leader_is_named_on_the_other_host(two_hosts):
    """4 ranks on two "hosts" (network namespaces, 2 ranks each: the hierarchical path), 2
    DataLoader workers: the leader rank 0 is killed between steps. Rank 1, on its host, names it
    from the kernel's notice; ranks 2 and 3, on the other host, from the group's store, where
    rank 1 wrote it (death_board.hpp) - each within 1 s of the kill, and each exits within 1 s."""
    victim, records, ended, ranks = _run("hosts-leader-between", "2", world=4, hosts=two_hosts)
    assert victim["pid"] == ranks[0].pid
    for r, rec in records.items():
        peer_death.assert_named(r, rec, ended, victim, 0, "two hosts")
