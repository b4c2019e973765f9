#!/usr/bin/env python3
"""What the data path costs a training step (issue 30, item 8): a real training loop, BASE against
spbcast's LeaderLoader with dedup, synchronous and prefetching, side by side in one run.

Every setting runs 4 ranks (spawned processes, Gloo, a FileStore in a fresh temporary directory)
through the same loop: a torch.utils.data.DataLoader with persistent worker processes over a
map-style dataset of deterministic samples (a dict of large uint8 and float32 tensors, a
RandomSampler), wrapped in spbcast.LeaderLoader, and a training step that sleeps (a GPU-bound step
leaves the CPU idle), then all-reduces a small CPU tensor over the world group (the gradients'
stand-in) and a page-strided checksum of the batch over the SP group (MAX of it and of its
negation: the SP ranks must have been given the same batch).

Arms (each a fresh LeaderLoader and DataLoader, in the same processes; the arms of a setting are
interleaved, round after round, so that a change in the machine's load falls on all of them):
  base          LeaderLoader(sp_media_dedup=False): every rank runs its own DataLoader.
  sync-<t>      dedup, prefetch=0: the leader fetches and broadcasts each batch in next().
  prefetch-<t>  dedup, prefetch=None (the default: 1 for a DataLoader with workers and torch's
                samplers): batch t + 1 is fetched and broadcast while the trainer runs step t.
  <t> is the transport: "auto" (same host: the same-host path; 2 hosts: the hierarchical path)
  or "network".

Settings: SP4 and SP2 x DP2 on this host; with --hosts (default where this runs as root with
ip(8) and tc(8)) SP4 over 2 "hosts" - two network namespaces of 2 ranks each, joined by a veth
pair that tc limits to --rate (1 Gbit/s) both ways, as python/tests/test_hosts.py does.

The step time is the time from the end of one step (after its all-reduces) to the end of the next,
the slowest rank's; per arm the median over the measured steps (the first --warmup steps of each
round are not measured: worker start-up, first batches). wait/step is LeaderLoader.stats()
["wait_seconds"] over the measured steps (what the trainer waited in next()); hits the
followers' prefetch_hits over the measured steps.

  ~/.cache/spbcast/venv/bin/python bench/step_overhead.py            # the table (~11 min here)
  ~/.cache/spbcast/venv/bin/python bench/step_overhead.py --quick    # ~1 min: 0.2 s steps, 8 MiB
Writes JSON (every rank's every step) and the markdown table to --out
(bench/results/step_overhead/ by default; the JSON is git-ignored).
"""

import argparse
import ctypes
import datetime
import json
import multiprocessing
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MiB = 1 << 20
WORLD = 4
RANKS_PER_HOST = 2
STAT_KEYS = ("steps", "bytes", "loader_seconds", "broadcast_seconds", "leader_loader_seconds",
             "wait_seconds", "prefetch_hits")


# ---- the data ----------------------------------------------------------------------------------

class Samples(torch.utils.data.Dataset):
    """Deterministic samples of ``sample_bytes``: 3/4 uint8 "pixel_values", 1/4 float32 "features",
    int64 "input_ids" and "labels" of 4096, the index. Each worker builds a random base pattern once;
    a sample is the pattern shifted by its index (one pass over its bytes, as a cheap decode)."""

    def __init__(self, length, sample_bytes):
        self.length = length
        self.pixels = sample_bytes * 3 // 4
        self.floats = (sample_bytes - self.pixels) // 4
        self._base = None

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        if self._base is None:
            g = torch.Generator().manual_seed(12345)
            self._base = (torch.randint(0, 256, (self.pixels,), generator=g, dtype=torch.uint8),
                          torch.randn(self.floats, generator=g),
                          torch.randint(0, 150000, (4096,), generator=g))
        pixels, floats, ids = self._base
        return {"pixel_values": pixels + (index % 251),
                "features": floats + float(index),
                "input_ids": ids + index,
                "labels": torch.roll(ids, index % 4096),
                "index": index}


def checksum(batch):
    """One byte per 4 KiB page of every tensor (so the followers map every page, as a copy to the
    GPU would) plus the indices: equal on every rank of an SP group that got the same batch."""
    total = 0
    for value in batch.values():
        flat = value.reshape(-1).view(torch.uint8) if value.dtype != torch.uint8 else value.reshape(-1)
        total += int(flat[::4096].to(torch.int64).sum())
    return total


# ---- one rank ----------------------------------------------------------------------------------

def enter_host(hosts, rank):
    """Moves this rank into its host's network namespace (before it joins the group); the
    DataLoader workers it forks later inherit it."""
    ns, dev = hosts[rank // RANKS_PER_HOST]
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns into {ns}: {os.strerror(err)}")
    finally:
        os.close(fd)
    os.environ["GLOO_SOCKET_IFNAME"] = dev


def run_arm(arm, cfg, sp_group, dp_rank, rank):
    import spbcast
    torch.manual_seed(1 + dp_rank)  # one seed per SP group: BASE's SP ranks shuffle alike
    total = cfg["warmup"] + cfg["steps"]
    dataset = Samples(cfg["dataset_length"], cfg["batch_bytes"] // cfg["batch_size"])

    def make_loader():
        return torch.utils.data.DataLoader(
            dataset, batch_size=cfg["batch_size"], shuffle=True, num_workers=cfg["workers"],
            persistent_workers=cfg["workers"] > 0,
            multiprocessing_context="fork" if cfg["workers"] > 0 else None)

    kwargs = {"sp_media_dedup": arm["dedup"], "total_step": total, "log_every": 0}
    if arm["dedup"]:
        kwargs.update(transport=arm["transport"], prefetch=arm["prefetch"])
    dist.barrier()
    began = time.monotonic()
    loader = spbcast.LeaderLoader(make_loader, sp_group, **kwargs)
    steps, mismatches = [], 0
    before = None
    last = time.monotonic()
    try:
        it = iter(loader)
        for i in range(total):
            asked = time.monotonic()
            batch = next(it)
            got = time.monotonic()
            mine = checksum(batch)
            time.sleep(cfg["step_seconds"])  # the GPU's part of the step
            grads = torch.ones(256)
            dist.all_reduce(grads)  # the gradients' all-reduce stand-in, over the world
            seen = torch.tensor([mine, -mine], dtype=torch.int64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=sp_group)
            mismatches += int(seen[0] != -seen[1])
            end = time.monotonic()
            steps.append({"next": got - asked, "step": end - last})
            last = end
            del batch
            if i == cfg["warmup"] - 1:
                before = loader.stats()
        after = loader.stats()
        try:
            next(it)
            ended = False
        except StopIteration:
            ended = True
        relay = None
        if arm["dedup"]:
            # The hosts the batches were relayed to (the hierarchical path), from the groups the
            # loader broadcast on: the SP group and, with prefetch, the loader's own channel.
            from spbcast._broadcast import _relay_hosts
            leader = dist.get_global_rank(sp_group, 0)
            for group in (sp_group, getattr(loader, "_channel", None)):
                if group is not None and relay is None:
                    relay = _relay_hosts(group, leader)
    finally:
        loader.close()
    return {"relay_hosts": relay, "rank": rank, "arm": arm["name"], "steps": steps, "mismatches": mismatches,
            "ended": ended, "stats_before": before, "stats": after,
            "is_leader": bool(loader.is_leader) if arm["dedup"] else None,
            "seconds": time.monotonic() - began}


def rank_main(rank, world, init_file, cfg, setting, arms, out_dir, hosts):
    torch.set_num_threads(1)
    if hosts:
        enter_host(hosts, rank)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    sp = setting["sp"]
    sp_group = None
    for d in range(world // sp):
        ranks = list(range(d * sp, d * sp + sp))
        group = dist.new_group(ranks)
        if rank in ranks:
            sp_group = group
    records = []
    try:
        for r in range(cfg["rounds"]):
            for arm in arms:
                record = run_arm(arm, cfg, sp_group, rank // sp, rank)
                record["round"] = r
                records.append(record)
                if rank == 0:
                    times = sorted(s["step"] for s in record["steps"][cfg["warmup"]:])
                    print(f"  {setting['name']} round {r} {arm['name']}: median "
                          f"{statistics.median(times):.3f} s ({record['seconds']:.0f} s)", flush=True)
        dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(records, f)
        dist.destroy_process_group()


# ---- two hosts ---------------------------------------------------------------------------------

def _tool(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


def make_hosts(rate):
    """Two namespaces joined by a rate-limited veth pair; returns ([(ns, dev)], cleanup) or
    (None, why)."""
    if os.geteuid() != 0:
        return None, "needs root to create network namespaces"
    if shutil.which("ip") is None or shutil.which("tc") is None:
        return None, "needs ip(8) and tc(8)"
    pid = os.getpid()
    hosts = [(f"spbcast_soa_{pid}", f"soA{pid}", "10.98.0.1"), (f"spbcast_sob_{pid}", f"soB{pid}", "10.98.0.2")]
    made = []

    def cleanup():
        for ns in made:
            _tool("ip", "netns", "del", ns)

    try:
        for ns, _, _ in hosts:
            done = _tool("ip", "netns", "add", ns)
            if done.returncode:
                raise RuntimeError(f"ip netns add: {done.stderr.strip()}")
            made.append(ns)
        (ns_a, dev_a, _), (ns_b, dev_b, _) = hosts
        cmds = [["ip", "-n", ns_a, "link", "add", dev_a, "type", "veth", "peer", "name", dev_b],
                ["ip", "-n", ns_a, "link", "set", dev_b, "netns", ns_b]]
        for ns, dev, addr in hosts:
            cmds += [["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                     ["ip", "-n", ns, "link", "set", "lo", "up"],
                     ["ip", "-n", ns, "link", "set", dev, "up"],
                     ["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
                      "burst", "256kb", "latency", "100ms"]]
        for cmd in cmds:
            done = _tool(*cmd)
            if done.returncode:
                raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip()}")
    except RuntimeError as e:
        cleanup()
        return None, str(e)
    return [(ns, dev) for ns, dev, _ in hosts], cleanup


# ---- the run -----------------------------------------------------------------------------------

def run_setting(setting, arms, cfg, hosts):
    return spawn_ranks(rank_main, lambda init_file, out_dir: (WORLD, init_file, cfg, setting, arms, out_dir, hosts),
                       cfg["timeout"], setting["name"])


def spawn_ranks(rank_main, args_for, timeout, what):
    """Spawns WORLD ranks, each running rank_main(rank, *args_for(init_file, out_dir)) (a FileStore
    and a directory in a fresh temporary directory); returns the records they wrote to
    out_dir/rank<N>.json, rank after rank. A rank that fails stops the others; so does ``timeout``."""
    with tempfile.TemporaryDirectory(prefix="spbcast-step-overhead.") as tmp:
        ctx = mp.start_processes(rank_main, args=args_for(os.path.join(tmp, "store"), tmp),
                                 nprocs=WORLD, join=False, start_method="spawn")
        end = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=max(0.1, end - time.monotonic())):
                if time.monotonic() > end:
                    raise TimeoutError(f"{what}: ranks still running after {timeout} s")
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        records = []
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                records += json.load(f)
    return records


def per_step(before, after, key, steps):
    if before is None or after is None:
        return None
    return (after[key] - before[key]) / steps


def summarize(setting, arms, cfg, records):
    rows = []
    warm = cfg["warmup"]
    for arm in arms:
        mine = [r for r in records if r["arm"] == arm["name"]]
        step_times = []
        for rnd in range(cfg["rounds"]):
            ranks = [r for r in mine if r["round"] == rnd]
            for i in range(warm, len(ranks[0]["steps"])):
                step_times.append(max(r["steps"][i]["step"] for r in ranks))  # the slowest rank's
        followers = [r for r in mine if r["is_leader"] is False]
        leaders = [r for r in mine if r["is_leader"] is True]
        if not arm["dedup"]:
            followers = [r for r in mine if r["rank"] % setting["sp"] != 0]
            leaders = [r for r in mine if r["rank"] % setting["sp"] == 0]

        def mean_of(group, key, scale=1.0):
            vals = [per_step(r["stats_before"], r["stats"], key, cfg["steps"]) for r in group]
            vals = [v for v in vals if v is not None]
            return statistics.mean(vals) * scale if vals else None

        stats = mine[0]["stats"]
        path = stats["path"]
        if arm["dedup"] and arm["transport"] == "auto" and any(r["relay_hosts"] for r in mine):
            # stats()["path"] says "same_host" on the hierarchical path here (spbcast at this commit)
            path = "hierarchical" if path == "hierarchical" else f"hierarchical (stats: {path})"
        rows.append({
            "setting": setting["name"], "arm": arm["name"], "dedup": arm["dedup"],
            "transport": arm.get("transport"), "path": path, "prefetch": stats["prefetch"],
            "prefetch_reason": stats["prefetch_reason"],
            "median_step_s": statistics.median(step_times),
            "p90_step_s": sorted(step_times)[int(0.9 * (len(step_times) - 1))],
            "measured_steps": len(step_times),
            "follower_wait_ms_per_step": mean_of(followers, "wait_seconds", 1e3),
            # next() as this loop timed it, every arm alike (stats() counts no wait in BASE)
            "follower_next_ms_mean": 1e3 * statistics.mean(
                s["next"] for r in followers for s in r["steps"][warm:]),
            "follower_next_ms_median": 1e3 * statistics.median(
                s["next"] for r in followers for s in r["steps"][warm:]),
            "follower_prefetch_hits": sum(r["stats"]["prefetch_hits"] - r["stats_before"]["prefetch_hits"]
                                          for r in followers),
            "follower_measured_steps": cfg["steps"] * len(followers),
            "leader_wait_ms_per_step": mean_of(leaders, "wait_seconds", 1e3),
            "leader_loader_ms_per_step": mean_of(leaders, "loader_seconds", 1e3),
            "mib_per_step": (stats["bytes"] / max(stats["steps"], 1)) / MiB,
            "batches_equal": all(r["mismatches"] == 0 for r in mine),
            "ended": all(r["ended"] for r in mine),
        })
    base = next((r["median_step_s"] for r in rows if r["arm"] == "base"), None)
    for row in rows:
        row["x_base"] = row["median_step_s"] / base if base else None
    return rows


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()  # after the command name: state, ppid, ...


def _worker_pids():
    """This process's children (its DataLoader workers)."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and int(_stat_fields(entry)[1]) == me:
                found.append(int(entry))
        except OSError:  # gone meanwhile
            pass
    return found


def usage():
    """Host memory (MiB: Pss_Anon + Pss_Shmem) and CPU seconds (user + system) of this process
    and its worker processes, now."""
    mib = cpu = 0.0
    for pid in [os.getpid()] + _worker_pids():
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                        mib += int(line.split()[1]) / 1024
            fields = _stat_fields(pid)
            cpu += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        except OSError:
            pass
    return {"mib": mib, "cpu_s": cpu}


# What a rank holds and spends, per role (the loop benches of the drop-ins: energon_step.py,
# swift_step.py): their markdown's sentence, header cells and row cells.
USAGE_NOTE = ("Memory: Pss_Anon + Pss_Shmem of a rank's process and its workers at the end of the "
              "measured steps; CPU: its process and its workers, per measured step.")
USAGE_HEADER = ("| leader: memory (MiB) | follower: memory (MiB) | 4 ranks: memory (MiB) "
                "| leader: CPU / step (s) | follower: CPU / step (s) ")


def slowest_step_times(mine, cfg):
    """An arm's measured step times, each the slowest rank's in its round."""
    return [max(r["steps"][i]["step"] for r in mine if r["round"] == rnd)
            for rnd in range(cfg["rounds"]) for i in range(cfg["warmup"], cfg["warmup"] + cfg["steps"])]


def next_ms_mean(records, cfg):
    """What these ranks waited in next(), on average over the measured steps, in ms."""
    return 1e3 * statistics.mean(s["next"] for r in records for s in r["steps"][cfg["warmup"]:])


def usage_by_role(mine, leaders, followers, rounds):
    """An arm's records (``mine``; each with usage()'s ``mib`` and ``cpu_s_per_step``): the mean
    leader's and follower's memory and CPU per step, and the last round's 4 ranks' memory together
    (what they hold at once)."""
    return {"leader_mib": statistics.mean(r["mib"] for r in leaders),
            "follower_mib": statistics.mean(r["mib"] for r in followers),
            "all_ranks_mib": sum(r["mib"] for r in mine if r["round"] == rounds - 1),
            "leader_cpu_s": statistics.mean(r["cpu_s_per_step"] for r in leaders),
            "follower_cpu_s": statistics.mean(r["cpu_s_per_step"] for r in followers)}


def usage_cells(row):
    return (f"| {row['leader_mib']:.0f} | {row['follower_mib']:.0f} | {row['all_ranks_mib']:.0f} "
            f"| {row['leader_cpu_s']:.3f} | {row['follower_cpu_s']:.3f} ")


def loader_fields(stats):
    """A record's prefetch depth and path, from a drop-in's stats(): None and "local" where the
    loader is the trainer's own (BASE)."""
    return {"prefetch": stats["prefetch"] if stats else None, "path": stats["path"] if stats else "local"}


# ---- a trainer's own loop (swift_step.py, verl_step.py) -----------------------------------------

def add_trainer_options(parser, name):
    """A trainer bench's options (swift_step.py, verl_step.py) besides --quick and its samples':
    the loader's workers, the step, how many steps and rounds, the timeout, the output folder."""
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--step-seconds", type=float, help="the step's sleep (default 0.5; quick 0.2)")
    parser.add_argument("--steps", type=int, help="measured steps per arm and round (default 12; quick 4)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per arm and round (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds, each running both arms (default 2; quick 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per arm before giving up")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name),
                        help=f"directory for the JSON and markdown (default bench/results/{name})")


def trainer_config(args):
    """The loop's configuration from add_trainer_options' options and --quick."""
    q = args.quick
    return {"workers": args.workers,
            "step_seconds": args.step_seconds if args.step_seconds is not None else (0.2 if q else 0.5),
            "steps": args.steps or (4 if q else 12), "warmup": args.warmup or (2 if q else 3),
            "rounds": args.rounds or (1 if q else 2)}


def trainer_run(name, trainer, version, args, cfg, write_data, run_arm, arms, sp, markdown, more=lambda mine: {}):
    """A trainer bench's run: ``write_data(folder, steps)`` writes the model and one pass of the
    loader's samples (the steps and 2 more: the leader's workers are still there, and counted, when
    the last measured step ends) to a fresh folder; the arms, round after round (trainer_rounds);
    their rows (trainer_rows, ``more``) and ``markdown(result)`` written to args.out. Returns the
    exit status: 1 where an SP group's batches differed."""
    tests = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python", "tests")
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = {"command": " ".join([f"bench/{name}.py"] + sys.argv[1:]), "machine": machine(),
              trainer: version, "date": datetime.date.today().isoformat(),
              "load_before": loadavg(), "config": cfg, "records": []}
    print(f"{name}: {result['machine']}, load {result['load_before']}, {cfg}", flush=True)
    with tempfile.TemporaryDirectory(prefix=f"spbcast-{name}.") as data:
        os.makedirs(os.path.join(data, "data"))
        write_data(data, cfg["warmup"] + cfg["steps"] + 2)
        trainer_rounds(run_arm, arms, cfg, data, tests, args.timeout, name, result)
    result.update(rows=trainer_rows(arms, result["records"], cfg, sp, more), load_after=loadavg(),
                  minutes=(time.monotonic() - started) / 60)
    write_results(args.out, name + "-quick" if args.quick else name, result, markdown(result))
    return 0 if all(r["sp_batches_equal"] for r in result["rows"]) else 1


def trainer_markdown(result, trainer, setup, wait_column, batch_column=False):
    """A trainer bench's table: ``trainer`` (its name and version, for the machine line), ``setup``
    (the ranks and their samples, up to the step), ``wait_column`` (what the followers' wait is),
    with the batch's size where ``batch_column``."""
    cfg = result["config"]
    batch = ["batch (MiB)"] if batch_column else []
    headers = ["arm", "path", "prefetch", *batch, "median step (s)", "x BASE", wait_column]
    lines = [f"Command: `{result['command']}`", "", machine_line(result, f"{trainer}, "), "",
             f"{setup}; a {cfg['step_seconds']} s step then all-reduces; {cfg['rounds']} rounds x {cfg['steps']} "
             f"measured steps per arm ({cfg['warmup']} warm-up steps a round). " + USAGE_NOTE, "",
             "| " + " | ".join(headers) + " " + USAGE_HEADER + "| SP batches equal |",
             "|---" * (len(headers) + 6) + "|"]
    for row in result["rows"]:
        cells = [row["arm"], row["path"], row["prefetch"] or "-", *([f"{row['batch_mib']:.1f}"] if batch_column else []),
                 f"{row['median_step_s']:.3f}", f"{row['x_base']:.3f}", f"{row['follower_next_ms_mean']:.1f}"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " " + usage_cells(row)
                     + f"| {'yes' if row['sp_batches_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def trainer_rank(rank, world, init_file, out_dir, round_, tests, run_arm, arm, cfg, data):
    """A spawned rank of a trainer's bench: the environment torchrun gives it, the Gloo group; writes
    the record of ``run_arm(arm, cfg, data, rank)`` to out_dir/rank<N>.json. ``tests``:
    python/tests, for the trainers' harnesses."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    # As under torchrun: DataLoader workers fork (a spawned rank would spawn them, and a trainer's
    # pickled dataset - ms-swift's template, without its model - would load again in each worker).
    multiprocessing.set_start_method("fork", force=True)
    sys.path.insert(0, tests)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    record = run_arm(arm, cfg, data, rank)
    record["round"] = round_
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump([record], f)
    dist.destroy_process_group()


def trainer_step(record, cfg, i, mine, sp_group):
    """Step ``i`` of a trainer's loop, once the batch is there: usage() at the first measured step;
    the step's sleep (a GPU-bound step leaves the CPU idle); an all-reduce over the world (the
    gradients' stand-in) and of ``mine``, the batch's checksum, over the SP group (MAX of it and of
    its negation: a mismatch where the SP ranks' batches differ); usage() after the last measured
    step. Returns the time the step ended."""
    if i == cfg["warmup"]:
        record["before"] = usage()
    time.sleep(cfg["step_seconds"])
    dist.all_reduce(torch.ones(256))
    seen = torch.tensor([mine, -mine], dtype=torch.int64)
    dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=sp_group)
    record["mismatches"] += int(seen[0] != -seen[1])
    end = time.monotonic()
    if i + 1 == cfg["warmup"] + cfg["steps"]:
        after = usage()
        record.update(mib=after["mib"], cpu_s_per_step=(after["cpu_s"] - record["before"]["cpu_s"]) / cfg["steps"])
    return end


def trainer_rounds(run_arm, arms, cfg, data, tests, timeout, name, result):
    """Every arm in 4 ranks of its own (a trainer's enable() is process-wide), arm after arm, round
    after round: each rank trainer_rank() running ``run_arm(arm, cfg, data, rank)``."""
    for round_ in range(cfg["rounds"]):
        for arm in arms:
            records = spawn_ranks(trainer_rank, lambda init_file, out_dir: (WORLD, init_file, out_dir, round_, tests,
                                                                            run_arm, arm, cfg, data),
                                  timeout, f"{name} {arm['name']}")
            result["records"] += records
            times = sorted(s["step"] for s in records[0]["steps"][cfg["warmup"]:])
            print(f"  round {round_} {arm['name']}: median {statistics.median(times):.3f} s", flush=True)


def trainer_rows(arms, records, cfg, sp, more=lambda mine: {}):
    """A row per arm: its path and prefetch, the median step and its ratio to BASE's (the first
    arm), the followers' wait, usage by role, whether the SP batches were equal; ``more(records)``
    adds a trainer's own columns."""
    rows = []
    for arm in arms:
        mine = [r for r in records if r["arm"] == arm["name"]]
        leaders = [r for r in mine if r["rank"] % sp == 0]
        followers = [r for r in mine if r["rank"] % sp != 0]
        rows.append({
            "arm": arm["name"], "path": mine[0]["path"], "prefetch": mine[0]["prefetch"],
            "median_step_s": statistics.median(slowest_step_times(mine, cfg)), **more(mine),
            "follower_next_ms_mean": next_ms_mean(followers, cfg),
            **usage_by_role(mine, leaders, followers, cfg["rounds"]),
            "sp_batches_equal": all(r["mismatches"] == 0 for r in mine)})
    for row in rows:
        row["x_base"] = row["median_step_s"] / rows[0]["median_step_s"]
    return rows


def machine():
    model = "?"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = "?"
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal"):
                mem = f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
                break
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except OSError:
        commit = "?"
    return {"nproc": os.cpu_count(), "cpu": model, "memory": mem, "torch": torch.__version__,
            "python": platform.python_version(), "host": socket.gethostname(), "commit": commit}


def fmt(v, spec):
    return "-" if v is None else format(v, spec)


def machine_line(result, trainer=""):
    """The table's "Machine:" line: where, with what (``trainer``: e.g. "accelerate 1.15.0, "), when."""
    m = result["machine"]
    return (f"Machine: {m['nproc']} CPUs ({m['cpu']}), {m['memory']}; torch {m['torch']}, {trainer}Python "
            f"{m['python']}; commit {m['commit']}; {result['date']}; load average {result['load_before']} "
            f"before, {result['load_after']} after; {result['minutes']:.1f} min.")


def markdown(result):
    cfg = result["config"]
    lines = [f"Command: `{result['command']}`", "", machine_line(result), "",
             f"4 ranks, a {cfg['batch_bytes'] / MiB:.0f} MiB batch ({cfg['batch_size']} samples) from a "
             f"DataLoader with {cfg['workers']} persistent workers, a {cfg['step_seconds']} s step then "
             f"all-reduces; {cfg['rounds']} rounds x {cfg['steps']} measured steps per arm "
             f"({cfg['warmup']} warm-up steps per round not measured).", "",
             "| setting | arm | path | prefetch | median step (s) | x BASE | followers: next() mean (ms) "
             "| followers: stats wait / step (ms) | followers: prefetch hits | leader: stats wait / step (ms) "
             "| SP batches equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        hits = (f"{row['follower_prefetch_hits']}/{row['follower_measured_steps']}" if row["dedup"] else "-")
        lines.append(
            f"| {row['setting']} | {row['arm']} | {row['path']} | {row['prefetch']} "
            f"| {row['median_step_s']:.3f} | {fmt(row['x_base'], '.3f')} "
            f"| {row['follower_next_ms_mean']:.1f} | {fmt(row['follower_wait_ms_per_step'], '.1f')} | {hits} "
            f"| {fmt(row['leader_wait_ms_per_step'], '.1f')} "
            f"| {'yes' if row['batches_equal'] else 'NO'} |")
    if result.get("skipped"):
        lines += ["", "Not run: " + "; ".join(result["skipped"])]
    return "\n".join(lines) + "\n"


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def add_loop_options(parser, rounds):
    """The options of a training-loop bench (this one, accelerate_step.py): the step, the batch,
    the loader's workers, how many steps and rounds; ``rounds``: the default rounds."""
    parser.add_argument("--quick", action="store_true",
                        help="8 MiB batches, 0.2 s steps, 1 round of 4 steps: about a minute")
    parser.add_argument("--step-seconds", type=float, help="the step's sleep (default 1.0; quick 0.2)")
    parser.add_argument("--batch-mib", type=float, help="batch size in MiB (default 64; quick 8)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers (default 2, persistent)")
    parser.add_argument("--steps", type=int, help="measured steps per arm and round (default 12; quick 4)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per arm and round (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help=f"rounds, each running every arm once (default {rounds}; quick 1)")
    parser.set_defaults(default_rounds=rounds)


def loop_config(args):
    """The loop's configuration from add_loop_options' options."""
    q = args.quick
    return {"step_seconds": args.step_seconds if args.step_seconds is not None else (0.2 if q else 1.0),
            "batch_bytes": int((args.batch_mib if args.batch_mib is not None else (8 if q else 64)) * MiB),
            "batch_size": args.batch_size, "workers": args.workers,
            "steps": args.steps or (4 if q else 12), "warmup": args.warmup or (2 if q else 3),
            "rounds": args.rounds or (1 if q else args.default_rounds)}


def write_results(out_dir, name, result, table):
    """The run's JSON (git-ignored) and its markdown table into ``out_dir``; prints the table."""
    with open(os.path.join(out_dir, name + ".json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(out_dir, name + ".md"), "w") as f:
        f.write(table)
    print()
    print(table)
    print(f"wrote {os.path.join(out_dir, name + '.json')} and .md")


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_loop_options(parser, rounds=2)
    parser.add_argument("--settings", default="sp4,sp2xdp2,hosts-sp4",
                        help="comma-separated: sp4, sp2xdp2, hosts-sp4 (2 namespace hosts x 2 ranks)")
    parser.add_argument("--transports", default="auto,network", help="comma-separated dedup transports")
    parser.add_argument("--rate", default="1gbit", help="the 2 hosts' link rate, for tc (default 1gbit)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per setting before giving up")
    parser.add_argument("--render", metavar="JSON",
                        help="print the table again from a run's JSON (its records), running nothing")
    parser.add_argument("--out", default=os.path.join(here, "results", "step_overhead"),
                        help="directory for the JSON and markdown (default bench/results/step_overhead)")
    args = parser.parse_args()
    if args.render:
        with open(args.render) as f:
            result = json.load(f)
        result["rows"] = []
        for setting in result["settings"]:
            result["rows"] += summarize(setting, result["arms"], result["config"],
                                        result["records"][setting["name"]])
        print(markdown(result))
        return 0
    q = args.quick
    cfg = dict(loop_config(args), timeout=args.timeout)
    cfg["dataset_length"] = cfg["batch_size"] * (cfg["steps"] + cfg["warmup"]) + 64
    arms = [{"name": "base", "dedup": False}]
    for t in args.transports.split(","):
        arms += [{"name": f"sync-{t}", "dedup": True, "transport": t, "prefetch": 0},
                 {"name": f"prefetch-{t}", "dedup": True, "transport": t, "prefetch": None}]
    settings = {"sp4": {"name": "SP4, 1 host", "sp": 4},
                "sp2xdp2": {"name": "SP2 x DP2, 1 host", "sp": 2},
                "hosts-sp4": {"name": f"SP4, 2 hosts x 2 at {args.rate}", "sp": 4, "hosts": True}}
    chosen = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in chosen:
        if s not in settings:
            parser.error(f"unknown setting {s!r}")
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = {"command": " ".join(["bench/step_overhead.py"] + sys.argv[1:]), "machine": machine(),
              "date": datetime.date.today().isoformat(), "load_before": loadavg(), "config": cfg,
              "rows": [], "records": {}, "skipped": [], "arms": arms, "settings": []}
    print(f"step_overhead: {result['machine']}, load {result['load_before']}, {cfg}", flush=True)
    for key in chosen:
        setting = settings[key]
        hosts, cleanup = None, None
        if setting.get("hosts"):
            hosts, cleanup = make_hosts(args.rate)
            if hosts is None:
                result["skipped"].append(f"{setting['name']}: {cleanup}")
                print(f"step_overhead: skipped {setting['name']}: {cleanup}", flush=True)
                continue
        try:
            print(f"step_overhead: {setting['name']}", flush=True)
            records = run_setting(setting, arms, cfg, hosts)
        finally:
            if cleanup is not None:
                cleanup()
        result["records"][setting["name"]] = records
        result["settings"].append(setting)
        result["rows"] += summarize(setting, arms, cfg, records)
    result["load_after"] = loadavg()
    result["minutes"] = (time.monotonic() - started) / 60
    write_results(args.out, "step_overhead-quick" if q else "step_overhead", result, markdown(result))
    bad = [r for r in result["rows"] if not (r["batches_equal"] and r["ended"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
