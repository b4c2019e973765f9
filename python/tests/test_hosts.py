"""A group that spans hosts, from Python: ranks in two network namespaces, which spbcast takes for
two hosts, joined by a veth pair as in scripts/netns_common.sh (here 10.97.0.1/24 and
10.97.0.2/24, names spbcast_spya_<pid> / spbcast_spyb_<pid>). With the default transport the group
must take the hierarchical path: the root's host sends one copy over the link, relayed in chunks
of relay_chunk_bytes. The link is slowed to 4 Mbit/s and the broadcasts run with a 0.5 s timeout,
so that a batch takes longer to cross than any one wait may last while a 64 KiB chunk takes a
fraction of it: the batches arrive only if every wait covers one chunk of the size passed from
Python (the default 4 MiB chunk would hold the whole batch, and time out).

Needs root, ip(8) and tc(8); skipped, saying why, where namespaces cannot be made.
"""

import ctypes
import functools
import os
import shutil
import subprocess
import time

import pytest
import torch
import torch.distributed as dist

import spbcast
from batches import assert_same
from dist_harness import run
from spbcast._loader import step_exchange as loader_module  # the module whose broadcast the steps use
from spbcast._broadcast import _relay_chunk_bytes, _relay_hosts

CHUNK = 64 << 10
RATE = "4mbit"  # 0.5 MB/s: a 64 KiB chunk crosses in about 0.13 s, a batch of _batch in 4 s or more
TIMEOUT = 0.5   # seconds; root_wait is generous, so only the transport's waits are this short
# How long past options.timeout the core waits for one message (wait_grace in
# include/spbcast/detail/transport/collective.hpp): the longest any single wait may last.
WAIT_GRACE = 2.0
RANKS_PER_HOST = 2
WORLD = 4


def _tool(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def two_hosts():
    """[(namespace, veth device)] for host 0 and host 1; both namespaces go afterwards, also when
    the test fails or setting them up fails half way."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create network namespaces (run the suite as root)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool}(8) from iproute2 is not installed")
    pid = os.getpid()
    hosts = [(f"spbcast_spya_{pid}", f"spyA{pid}", "10.97.0.1"), (f"spbcast_spyb_{pid}", f"spyB{pid}", "10.97.0.2")]
    made = []

    def step(cmd, skip_why=None):
        done = _tool(*cmd)
        if done.returncode != 0:
            why = f"{' '.join(cmd)}: {done.stderr.strip()}"
            if skip_why:
                pytest.skip(f"{skip_why}: {why}")
            pytest.fail(why)

    try:
        for ns, _, _ in hosts:
            step(["ip", "netns", "add", ns], "cannot create a network namespace")
            made.append(ns)
        (ns_a, dev_a, _), (ns_b, dev_b, _) = hosts
        # Created in host 0's namespace, so deleting the namespaces removes the pair in any case.
        step(["ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b], "no veth pairs here")
        step(["ip", "-n", ns_a, "link", "set", dev_b, "netns", ns_b])
        for ns, dev, addr in hosts:
            step(["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev])
            step(["ip", "-n", ns, "link", "set", "lo", "up"])
            step(["ip", "-n", ns, "link", "set", dev, "up"])
            step(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", RATE, "burst", "32kb",
                  "latency", "400ms"], "tc cannot limit the link")
        yield [(ns, dev) for ns, dev, _ in hosts]
    finally:
        for ns in made:
            _tool("ip", "netns", "del", ns)


_CLONE_NEWNET = 0x40000000


def _enter_host(hosts, rank):
    """Moves this rank into its host's namespace before it joins the group. Done here rather than
    with `ip netns exec`, since multiprocessing starts the interpreter itself; threads started
    from now on (Gloo's, spbcast's keep-alive) inherit the namespace."""
    ns, dev = hosts[rank // RANKS_PER_HOST]
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)
    # Gloo's default device would take the address of the machine's hostname, which does not
    # exist in the namespace; the veth's address is the host's only way to the other host.
    os.environ["GLOO_SOCKET_IFNAME"] = dev


def _tx_bytes(dev):
    # /proc/net/dev is this process's namespace's (sysfs would still show the namespace it was
    # mounted in).
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, counters = line.partition(":")
            if name.strip() == dev:
                return int(counters.split()[8])
    raise AssertionError(f"no interface {dev} in this namespace")


def _batch(seed):
    """About 2.1 MiB of tensors: views of a bigger tensor (one whose base travels too, one whose
    base does not), a stride-0 view, a tensor referenced twice, several dtypes."""
    g = torch.Generator().manual_seed(seed)
    frames = torch.randn(6, 128, 512, generator=g)  # 1.5 MiB
    ids = torch.randint(0, 150000, (1, 4096), generator=g)
    cu = torch.tensor([0, 1000, 4096], dtype=torch.int32)
    bigger = torch.randn(512, 384, generator=g)  # 0.75 MiB, of which only a half is in the batch
    return {
        "frames": frames,
        "pixel_values": frames[1:3].transpose(1, 2),
        "rows": bigger[100:356],
        "input_ids": ids,
        "position_ids": torch.arange(4096).expand(3, 4096),
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "half": torch.randn(96, 64, generator=g).to(torch.bfloat16),
        "mask": torch.rand(4096, generator=g) > 0.5,
        "num_padding": 17,
    }


def _used_bytes(batch):
    """The bytes the batch's tensors reach, per storage from the first to the last byte any of
    them reads: one copy of the batch (every byte in those spans is read, in _batch)."""
    spans = {}
    for t in batch.values():
        if isinstance(t, torch.Tensor) and t.numel():
            size = t.element_size()
            start = t.storage_offset() * size
            end = start + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * size
            key = t.untyped_storage().data_ptr()
            lo, hi = spans.get(key, (start, end))
            spans[key] = (min(lo, start), max(hi, end))
    return sum(hi - lo for lo, hi in spans.values())


class _Samples(torch.utils.data.Dataset):
    """Four samples, two steps of 0.5 MiB at batch size 2."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(100 + i)
        return {"pixels": torch.randn(64, 1024, generator=g), "ids": torch.randint(0, 1000, (512,), generator=g),
                "index": i}


def _make_loader():
    return torch.utils.data.DataLoader(_Samples(), batch_size=2)


def _hosts_ranks(rank, world, hosts):
    host = rank // RANKS_PER_HOST
    dev = hosts[host][1]
    # The handshake of each root, with the default timeout; it must find two hosts of two
    # ranks and pick the hierarchical path.
    for root in (0, 3):
        assert spbcast.broadcast(torch.arange(4) if rank == root else None, src=root).tolist() == [0, 1, 2, 3]
    assert _relay_hosts(None, 0) == [(0, [1]), (2, [3])], _relay_hosts(None, 0)
    # A root that is not the lowest rank of its host leads its host; the chain starts there.
    assert _relay_hosts(None, 3) == [(3, [2]), (0, [1])], _relay_hosts(None, 3)

    for root, seed in ((0, 1), (3, 2)):
        expected = _batch(seed)  # every rank builds the root's batch, to compare with
        dist.barrier()
        sent_before = _tx_bytes(dev)
        start = time.monotonic()
        got = spbcast.broadcast(expected if rank == root else None, src=root, timeout=TIMEOUT, root_wait=60,
                                relay_chunk_bytes=CHUNK)
        took = time.monotonic() - start
        dist.barrier()
        sent = _tx_bytes(dev) - sent_before
        assert_same(expected, got, f"batch from root {root}")
        if host != root // RANKS_PER_HOST:
            # The relay outlasted any single wait: without per-chunk waits of the chunk passed
            # in, the other host could not have received it.
            assert took > TIMEOUT + WAIT_GRACE, f"rank {rank}: the batch from root {root} took only {took:.2f} s"
        if rank == root:
            # One copy over the link (the network path sends one per rank of the root's host):
            # about the batch's bytes, as this is the link they cross, and well under two.
            used = _used_bytes(expected)
            assert 0.9 * used < sent < 1.5 * used, f"root {root}: {sent} bytes over the link for a batch of {used}"
        del got

    # LeaderLoader over the same group: only the SP leader (rank 0) loads, every rank gets its
    # batches, and each of its broadcasts carries the chunk (the timed ones above show that
    # broadcast hands it to the core), with the same short timeout: a step takes about 1 s to
    # relay here, and a follower on the leader's host waits for the leader's relay reports, one
    # at a time, not for the whole relay in its next step's wait.
    chunks = []
    real_broadcast = loader_module.broadcast

    def recording(*args, **kwargs):
        chunks.append(kwargs.get("relay_chunk_bytes"))
        return real_broadcast(*args, **kwargs)

    loader_module.broadcast = recording  # this rank's process ends with the test
    expected = list(_make_loader())
    loader = spbcast.LeaderLoader(_make_loader, None, sp_media_dedup=True, total_epoch=1, relay_chunk_bytes=CHUNK,
                                  timeout=TIMEOUT)
    assert (loader.loader is None) == (rank != 0)
    assert len(loader) == len(expected)
    got = list(loader)
    assert len(got) == len(expected) and loader.step == len(expected)
    for i, (want, batch) in enumerate(zip(expected, got)):
        assert_same(want, batch, f"step {i}")
    assert chunks == [CHUNK] * (len(expected) + 2), chunks  # the loader's init, each step, the end
    assert loader.stats()["path"] == "hierarchical", loader.stats()


def test_broadcast_and_leader_loader_over_two_hosts(two_hosts):
    run(WORLD, _hosts_ranks, two_hosts, prepare=functools.partial(_enter_host, two_hosts), timeout=120)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "64k", [CHUNK]])
def test_relay_chunk_bytes_is_checked(bad):
    # Refused before torch.distributed is looked at (it is not initialized here), so before any
    # collective.
    with pytest.raises(ValueError, match=r"relay_chunk_bytes must be a positive int of bytes \(got "):
        spbcast.broadcast(None, relay_chunk_bytes=bad)
    with pytest.raises(ValueError, match="invalid LeaderLoader configuration: relay_chunk_bytes must be"):
        spbcast.LeaderLoader(list, None, sp_media_dedup=True, total_epoch=1, relay_chunk_bytes=bad)


def test_relay_chunk_bytes_beyond_the_core_bound_is_capped():
    # The core clamps to 1 GiB; an int beyond a size_t reaches it as that bound, not an OverflowError.
    assert _relay_chunk_bytes(1 << 70) == spbcast._C.MAX_RELAY_CHUNK_BYTES == 1 << 30
    assert _relay_chunk_bytes(CHUNK) == CHUNK and _relay_chunk_bytes(None) is None
