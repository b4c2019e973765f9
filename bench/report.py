#!/usr/bin/env python3
"""Run spbcast's benchmarks in one go and publish them: JSON, a markdown table and a PNG plot.

One run measures, on the same machine and the same batches (examples/common/profiles.hpp and
its port in python_peers.py):

  * the C++ grid (build/<tree>/bench/spbcast_bench): raw, raw_fresh, spbcast, naive and
    c10d broadcast_coalesced, every cell on its own loopback Gloo group;
  * the Python peers (bench/python_peers.py on the PyTorch wheel): broadcast_object_list,
    the accelerate-style dispatch and TensorDict.broadcast;
  * optionally (--compile) the compile-time cost (bench/compile_cost.py);

then merges them, checks issue 5's targets and writes into the results folder:

  results.json   everything: machine, versions, commands, every row, the target checks
  results.md     the tables (machine, LibTorch and PyTorch versions and the command in the header)
  results.png    ms per step against world size, per profile and micro-batch count

The results folder is in the build tree (build/bench-results/<full|quick>, or --out). The
repository keeps only the human-facing summary of a published run, results.md and results.png,
in bench/results/<run>/ (copied there by hand; no machine paths in either).

  python bench/report.py                       # the full grid (see README for the time it takes)
  python bench/report.py --quick               # CI: one small cell, checks, well under a minute

--quick runs text and qwen3-vl-image at micro-batch 1 on 2 ranks with 3 repeats and fails (exit
status 1) unless spbcast delivered the root's batch bit-exactly, every C++ method ran, and
spbcast used at most 2 collectives per step where the payload fits one bucket.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import pathlib
import platform
import re
import shlex
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
MiB = 2**20

CPP_METHODS = ["raw", "raw_fresh", "spbcast", "spbcast_shm", "spbcast_shm_alloc", "naive", "coalesced"]
SHM_METHODS = ["spbcast_shm", "spbcast_shm_alloc"]
PY_METHODS = ["pickle", "accelerate", "tensordict", "spbcast-py"]
MEDIA_PROFILES = ["qwen3-vl-image", "interns1-tiles", "qwen3-vl-video-long"]
LABELS = {
    "raw": "raw (1 buffer, reused)",
    "raw_fresh": "raw, fresh buffer",
    "spbcast": "spbcast::broadcast (network)",
    "spbcast_shm": "spbcast::broadcast (same host)",
    "spbcast_shm_alloc": "spbcast::broadcast (same host, leader allocates in shared memory)",
    "naive": "naive (meta + per tensor)",
    "coalesced": "c10d broadcast_coalesced",
    "pickle": "py: broadcast_object_list",
    "accelerate": "py: accelerate-style",
    "tensordict": "py: TensorDict.broadcast",
    "spbcast-py": "py: spbcast.broadcast",
}


def cache_value(build: pathlib.Path, key: str) -> str | None:
    try:
        m = re.search(rf"^{key}:\w+=(.*)$", (build / "CMakeCache.txt").read_text(), re.M)
    except OSError:
        return None
    return m.group(1) if m else None


def find_python(explicit: str | None, build: pathlib.Path) -> str:
    """The first of --python, $SPBCAST_PYTHON, the build's SPBCAST_PYTHON, the set-up script's
    venv and this interpreter that can import torch."""
    candidates = [explicit, os.environ.get("SPBCAST_PYTHON"), cache_value(build, "SPBCAST_PYTHON"),
                  str(pathlib.Path.home() / ".cache/spbcast/venv/bin/python"), sys.executable]
    for c in candidates:
        if not c:
            continue
        try:
            if subprocess.run([c, "-c", "import torch"], capture_output=True, timeout=120).returncode == 0:
                return c
        except (OSError, subprocess.TimeoutExpired):
            continue
        if c == explicit:
            raise SystemExit(f"--python {c} cannot import torch")
    return sys.executable


def default_build() -> pathlib.Path:
    for name in ("wheel", "system"):
        if (ROOT / "build" / name / "bench/spbcast_bench").exists():
            return ROOT / "build" / name
    return ROOT / "build/system"


def run(cmd: list[str], log: pathlib.Path, timeout: float) -> int:
    """Runs cmd, echoing its stderr lines (progress) and keeping everything in log."""
    print("+ " + " ".join(shlex.quote(c) for c in cmd), file=sys.stderr, flush=True)
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + timeout
        for line in proc.stdout:
            out.write(line)
            if line.startswith("[") or "FAILED" in line or "error" in line.lower():
                print("  " + line.rstrip(), file=sys.stderr, flush=True)
            if time.monotonic() > deadline:
                proc.kill()
                print(f"  killed after {timeout:.0f} s", file=sys.stderr)
                break
        return proc.wait()


def fmt_bytes(n) -> str:
    if n is None:
        return "-"
    if abs(n) >= 1024 * MiB:
        return f"{n / 1024 / MiB:.2f} GiB"
    if abs(n) >= MiB:
        return f"{n / MiB:.1f} MiB"
    return f"{n / 1024:.0f} KiB"


def fmt_ms(v) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if v < 1 else f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


# ---------------------------------------------------------------------------------------------
# Merging and the targets

def merge(cpp: dict, py: dict | None) -> list[dict]:
    rows = [dict(r, impl="cpp") for r in cpp["results"]]
    if py:
        rows += [dict(r, impl="python") for r in py["results"]]
    cells = {}
    for r in rows:
        cells.setdefault((r["profile"], r["micro_batches"], r["world_size"]), {})[r["method"]] = r
    for key, by in cells.items():
        raw = by.get("raw")
        raw_ms = raw["ms_median"] if raw and raw.get("status") == "ok" else None
        fresh = by.get("raw_fresh")
        fresh_ms = fresh["ms_median"] if fresh and fresh.get("status") == "ok" else None
        for r in by.values():
            ok = r.get("status") == "ok" and r.get("ms_median")
            r["ratio_to_raw"] = r["ms_median"] / raw_ms if ok and raw_ms else None
            r["ratio_to_raw_fresh"] = r["ms_median"] / fresh_ms if ok and fresh_ms else None
            p = r.get("payload_bytes")
            fe = r.get("follower_extra_bytes")
            r["follower_extra_per_payload"] = fe / p if fe is not None and p else None
    return rows


def cell_key(r):
    return (r["profile"], r["micro_batches"], r["world_size"])


def cell_order(key):
    """Cells in the order the tables list them: profile, then micro-batches, then ranks."""
    return (profile_order(key[0]), key[1], key[2])


def ok_row(r) -> bool:
    return r is not None and r.get("status") == "ok"


def fastest_peer(methods: dict) -> dict | None:
    """The fastest Python peer of a cell; spbcast's own Python package is not a peer."""
    peers = [r for n, r in methods.items() if r.get("impl") == "python" and ok_row(r) and n != "spbcast-py"]
    return min(peers, key=lambda r: r["ms_median"]) if peers else None


def cell_payload(methods: dict):
    return next((r.get("payload_bytes") for r in methods.values() if r.get("payload_bytes")), None)


def check_targets(rows: list[dict], bucket_bytes: int, max_in_flight: int = 2) -> list[dict]:
    """One entry per (target, cell) that the run can judge."""
    by = {}
    for r in rows:
        by.setdefault(cell_key(r), {})[r["method"]] = r
    checks = []

    def add(target, key, ok, value, detail):
        checks.append({"target": target, "profile": key[0], "micro_batches": key[1],
                       "world_size": key[2], "met": bool(ok), "value": value, "detail": detail})

    for key, methods in sorted(by.items()):
        sp = methods.get("spbcast")
        if not sp or sp.get("status") != "ok":
            if sp and sp.get("status") == "error":  # a skipped cell (memory, deadline) judges nothing
                add("spbcast runs and is correct", key, False, None, f"{sp.get('status')}: {sp.get('reason')}")
            continue
        payload = sp["payload_bytes"]
        add("spbcast delivers the root's batch bit-exactly", key, sp.get("correct") is True,
            sp.get("correct"), "spbcast::digest on every follower equals the root's")
        ratio = sp.get("ratio_to_raw")
        if ratio is not None and payload >= 8 * MiB:
            add("spbcast <= 1.10x raw (payload >= 8 MiB)", key, ratio <= 1.10, ratio,
                f"{ratio:.2f}x raw; {sp['ratio_to_raw_fresh']:.2f}x raw_fresh" if sp.get("ratio_to_raw_fresh") else f"{ratio:.2f}x raw")
        if ratio is not None and payload < 1 * MiB:
            add("spbcast <= 1.5x raw (payload < 1 MiB)", key, ratio <= 1.5, ratio, f"{ratio:.2f}x raw")
        if payload <= bucket_bytes:
            add("<= 2 collectives per step when the payload fits one bucket", key,
                sp["collectives"] <= 2, sp["collectives"], f"{sp['collectives']} collectives, payload {fmt_bytes(payload)}")
        if sp.get("follower_extra_per_payload") is not None:
            f = sp["follower_extra_per_payload"]
            tensors = sp.get("follower_tensor_extra_bytes")
            add("follower extra memory <= 1.1x payload", key, f <= 1.1, f,
                f"RSS {fmt_bytes(sp['follower_extra_bytes'])} for {fmt_bytes(payload)} ({f:.2f}x)"
                + (f"; tensors {tensors / payload:.2f}x" if tensors is not None else ""))
        if sp.get("leader_extra_bytes") is not None:
            budget = max_in_flight * bucket_bytes
            add("leader extra memory <= bucket budget", key, sp["leader_extra_bytes"] <= budget,
                sp["leader_extra_bytes"], f"RSS {fmt_bytes(sp['leader_extra_bytes'])}, tensors "
                f"{fmt_bytes(sp.get('leader_tensor_extra_bytes'))} (budget {max_in_flight} x {fmt_bytes(bucket_bytes)})")
        if key[0] in MEDIA_PROFILES and key[2] == 4:
            # spbcast's own Python package is judged against the C++ path below.
            best = fastest_peer(methods)
            if best:
                speedup = best["ms_median"] / sp["ms_median"]
                raw = methods.get("raw")
                bound = best["ms_median"] / raw["ms_median"] if raw and raw.get("status") == "ok" else None
                add(">= 3x faster than the fastest Python peer (media, world 4)", key, speedup >= 3, speedup,
                    f"{speedup:.2f}x vs {best['method']} ({fmt_ms(best['ms_median'])} ms)"
                    + (f"; even raw is only {bound:.2f}x faster than it" if bound else ""))
        py = methods.get("spbcast-py")
        if py and py.get("status") == "ok" and key[0] in MEDIA_PROFILES:
            ratio = py["ms_median"] / sp["ms_median"]
            add("spbcast from Python <= 1.15x the C++ path (media)", key, ratio <= 1.15, ratio,
                f"{fmt_ms(py['ms_median'])} ms vs {fmt_ms(sp['ms_median'])} ms ({ratio:.2f}x)")
            pk = methods.get("pickle")
            if pk and pk.get("status") == "ok":
                speedup = pk["ms_median"] / py["ms_median"]
                add("spbcast from Python >= 5x faster than broadcast_object_list (media)", key,
                    speedup >= 5, speedup, f"{speedup:.1f}x ({fmt_ms(pk['ms_median'])} ms vs "
                    f"{fmt_ms(py['ms_median'])} ms)")
    checks += check_same_host_targets(by)
    return checks


def check_same_host_targets(by: dict) -> list[dict]:
    """Issue 9's targets for the same-host methods, each method judged on its own."""
    checks = []
    for name in SHM_METHODS:
        label = "same host" if name == "spbcast_shm" else "same host, leader allocates"

        def add(target, key, met, value, detail):
            checks.append({"target": f"{label}: {target}", "profile": key[0], "micro_batches": key[1],
                           "world_size": key[2], "met": bool(met), "value": value, "detail": detail})

        for key, methods in sorted(by.items()):
            m = methods.get(name)
            if not ok_row(m):
                continue
            add("delivers the root's batch bit-exactly", key, m.get("correct") is True, m.get("correct"),
                "spbcast::digest on every follower equals the root's")
            ratio, payload = m.get("ratio_to_raw"), m["payload_bytes"]
            if ratio is None:
                continue
            bound = {4: 0.35, 8: 0.2}.get(key[2])
            if bound and payload >= 8 * MiB:
                add(f"<= {bound}x raw (payload >= 8 MiB, world {key[2]})", key, ratio <= bound, ratio, f"{ratio:.2f}x raw")
            if key[0] == "text" and payload < 1 * MiB:
                add("<= 1.0x raw (text under 1 MiB)", key, ratio <= 1.0, ratio, f"{ratio:.2f}x raw")
        for (profile, mb, world), methods in sorted(by.items()):
            if world != 8 or not ok_row(methods.get(name)) or methods[name]["payload_bytes"] < 8 * MiB:
                continue
            two = by.get((profile, mb, 2), {}).get(name)
            if ok_row(two):
                growth = methods[name]["ms_median"] / two["ms_median"]
                add("time at 8 ranks <= 1.3x the time at 2 (payload >= 8 MiB)", (profile, mb, world), growth <= 1.3,
                    growth, f"{fmt_ms(methods[name]['ms_median'])} ms at 8 vs {fmt_ms(two['ms_median'])} ms at 2 ({growth:.2f}x)")
    return checks


def group_memory(shm_worker: pathlib.Path, profiles: list[str], micro_batches: int, worlds: list[int],
                 out: pathlib.Path, timeout: float) -> list[dict]:
    """Group memory while a batch is alive - the sum of every rank's Pss_Anon change plus the change
    in the host's Shmem, over the payload - for the network path, the same-host path and the
    same-host path with the leader allocating in shared memory (tests/shm_worker.cpp). The worker
    starts its own ranks (`ranks`, the test kit's launcher): it hosts their store on a port the
    kernel picks, where a port found by binding and closing could be taken before rank 0 binds it."""
    rows = []
    for profile in profiles:
        for world in worlds:
            for arm, extra in (("network", ["network"]), ("same host", ["auto"]),
                               ("same host, leader allocates", ["auto", "leader_allocates"])):
                log = out / f"group-memory-{profile}-{world}-{extra[-1]}.log"
                cmd = [str(shm_worker), "ranks", str(world), "group_memory", profile, str(micro_batches)] + extra
                with open(log, "w") as f:
                    try:
                        # A minute past the launcher's own deadline, at which it stops its ranks.
                        code = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout + 60).returncode
                    except subprocess.TimeoutExpired:
                        code = None
                text = log.read_text()
                found = re.search(r"^.*?([0-9.]+)x the payload.*$", text, re.M)  # rank 0's result line
                rows.append({"profile": profile, "micro_batches": micro_batches, "world_size": world, "arm": arm,
                             "ratio": float(found.group(1)) if found and code == 0 else None,
                             "line": found.group(0) if found else (text.strip().splitlines() or [""])[-1]})
                print(f"  group memory {profile} mb={micro_batches} ws={world} {arm}: {rows[-1]['ratio']}", file=sys.stderr)
    return rows


def check_memory_targets(rows: list[dict]) -> list[dict]:
    bounds = {"same host": 2.2, "same host, leader allocates": 1.2}
    return [{"target": f"{r['arm']}: group memory <= {bounds[r['arm']]}x the payload", "profile": r["profile"],
             "micro_batches": r["micro_batches"], "world_size": r["world_size"],
             "met": r["ratio"] is not None and r["ratio"] <= bounds[r["arm"]], "value": r["ratio"],
             "detail": f"{r['ratio']:.2f}x" if r["ratio"] is not None else "did not run"}
            for r in rows if r["arm"] in bounds]


def all_targets(rows: list[dict], bucket_bytes: int, memory: list[dict]) -> list[dict]:
    """Every target a run judges: per cell from the grid, and the group-memory runs'."""
    return check_targets(rows, bucket_bytes) + check_memory_targets(memory)


# ---------------------------------------------------------------------------------------------
# Output

def library_kind(path: str) -> str:
    """Which LibTorch, without the path of the machine that ran the benchmark."""
    return "the PyTorch wheel" if "site-packages" in path else "the distribution's libtorch-dev"


def markdown(doc: dict) -> str:
    rows, cpp, py = doc["rows"], doc["cpp"], doc.get("python")
    m = cpp["machine"]
    lines = [
        f"## spbcast benchmark results ({doc['mode']})",
        "",
        f"- Machine: {m['cpu_model']}, {m['usable_cores']} usable cores ({m['logical_cores']} logical), "
        f"{m['mem_total_bytes'] / 2**30:.1f} GiB memory; {doc['platform']}; load average at start "
        f"{m['loadavg_at_start'][0]:.2f} (the cores are shared).",
        f"- C++: LibTorch {cpp['libtorch']['version']} ({library_kind(cpp['libtorch']['library'])}), Gloo on loopback, "
        f"{cpp['config']['threads']} intra-op thread per rank, bucket {fmt_bytes(cpp['config']['bucket_bytes'])}.",
    ]
    if py:
        lines.append(f"- Python peers: PyTorch {py['torch']}, tensordict {py.get('tensordict')}, Python {py['python']}.")
    lines += [
        f"- Command: `{doc['command']}` ({doc['date']}, {doc['elapsed_s'] / 60:.1f} min).",
        "- Each step starts with a barrier; its time is the slowest rank's. Median (min-max) over the "
        "timed repeats after warm-up; C++ methods are interleaved round by round. GiB/s is payload "
        "(distinct tensor bytes) per second. Extra memory: peak RSS over the warm-up steps minus RSS "
        "before them (VmHWM reset through /proc/self/clear_refs); in parentheses, for the C++ methods, the "
        "peak of live tensor bytes over the same steps (a counting CPU allocator: exact, free of heap noise).",
        "",
    ]
    # Summary: one line per cell.
    by = {}
    for r in rows:
        by.setdefault(cell_key(r), {})[r["method"]] = r
    lines += [
        "### Summary",
        "",
        "| profile | mb | ranks | payload | raw ms | spbcast ms | x raw | x raw_fresh | colls | follower extra RSS (tensors) | leader extra RSS (tensors) | best C++ other | fastest Python peer | spbcast speed-up |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key in sorted(by, key=cell_order):
        ms = by[key]
        sp, raw = ms.get("spbcast"), ms.get("raw")
        others = [r for n, r in ms.items() if n in ("naive", "coalesced") and ok_row(r)]
        best_other = min(others, key=lambda r: r["ms_median"]) if others else None
        best_peer = fastest_peer(ms)
        payload = cell_payload(ms)
        if not ok_row(sp):
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {fmt_bytes(payload)} | "
                         f"{fmt_ms(raw['ms_median']) if ok_row(raw) else '-'} | {sp.get('status') if sp else '-'} | | | | | | | | |")
            continue
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {fmt_bytes(payload)} | {fmt_ms(raw['ms_median']) if ok_row(raw) else '-'} "
            f"| {fmt_ms(sp['ms_median'])} | {sp['ratio_to_raw']:.2f} | "
            f"{sp['ratio_to_raw_fresh']:.2f} | {sp['collectives']} | "
            f"{fmt_bytes(sp['follower_extra_bytes'])} ({sp['follower_extra_per_payload']:.2f}x) "
            f"({fmt_bytes(sp.get('follower_tensor_extra_bytes'))}) | "
            f"{fmt_bytes(sp['leader_extra_bytes'])} ({fmt_bytes(sp.get('leader_tensor_extra_bytes'))}) | "
            + (f"{best_other['method']} {fmt_ms(best_other['ms_median'])} ({best_other['ms_median'] / sp['ms_median']:.2f}x) | " if best_other else "- | ")
            + (f"{best_peer['method']} {fmt_ms(best_peer['ms_median'])} | {best_peer['ms_median'] / sp['ms_median']:.2f}x |" if best_peer else "- | - |"))
    lines += ["", "`x raw`: spbcast's time over raw's. `best C++ other` and `spbcast speed-up`: their time over spbcast's (above 1: spbcast is faster).", ""]

    # The same-host path, side by side with raw, the network path and the Python peers.
    if any(r["method"] in SHM_METHODS for r in rows):
        lines += [
            "### The same-host path",
            "",
            "| profile | mb | ranks | payload | raw ms | network ms (x raw) | same host ms (x raw) | same host, leader allocates ms (x raw) | colls net / same host | fastest Python peer ms | correct |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for key in sorted(by, key=cell_order):
            ms = by[key]
            cols = []
            for name in ("spbcast",) + tuple(SHM_METHODS):
                r = ms.get(name)
                cols.append(f"{fmt_ms(r['ms_median'])} ({r['ratio_to_raw']:.2f}x)" if ok_row(r) and r.get("ratio_to_raw") else (r.get("status") if r else "-"))
            best_peer = fastest_peer(ms)
            payload = cell_payload(ms)
            raw = ms.get("raw")
            colls = " / ".join(str(ms[n]["collectives"]) if ok_row(ms.get(n)) else "-" for n in ("spbcast", "spbcast_shm"))
            correct = ", ".join(str(ms[n].get("correct")) if ok_row(ms.get(n)) else "-" for n in ("spbcast",) + tuple(SHM_METHODS))
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {fmt_bytes(payload)} | {fmt_ms(raw['ms_median']) if ok_row(raw) else '-'} | "
                         + " | ".join(cols) + f" | {colls} | "
                         + (f"{best_peer['method']} {fmt_ms(best_peer['ms_median'])}" if best_peer else "-") + f" | {correct} |")
        lines.append("")
    if doc.get("group_memory"):
        lines += ["### Group memory while a batch is alive", "",
                  "The sum over the ranks of the change in `Pss_Anon` plus the change in the host's `Shmem`, from before "
                  "the root builds its batch until every rank holds it, over the payload (`tests/shm_worker.cpp group_memory`).", "",
                  "| profile | mb | ranks | network | same host | same host, leader allocates |", "|---|---|---|---|---|---|"]
        gm = {}
        for r in doc["group_memory"]:
            gm.setdefault((r["profile"], r["micro_batches"], r["world_size"]), {})[r["arm"]] = r["ratio"]
        for key in sorted(gm, key=cell_order):
            cell = gm[key]
            lines.append(f"| {key[0]} | {key[1]} | {key[2]} | "
                         + " | ".join(f"{cell[a]:.2f}x" if cell.get(a) is not None else "-"
                                      for a in ("network", "same host", "same host, leader allocates")) + " |")
        lines.append("")

    # Targets.
    lines += ["### Targets", "", "| target | met | cells | worst |", "|---|---|---|---|"]
    groups = {}
    for c in doc["targets"]:
        groups.setdefault(c["target"], []).append(c)
    for target, cs in groups.items():
        missed = [c for c in cs if not c["met"]]
        worst = missed or cs
        numeric = [c for c in worst if isinstance(c["value"], (int, float)) and not isinstance(c["value"], bool)]
        if numeric:
            pick = max(numeric, key=lambda c: c["value"]) if not target.startswith(">=") else min(numeric, key=lambda c: c["value"])
        else:
            pick = worst[0]
        where = ", ".join("%s/mb%d/ws%d" % (c["profile"], c["micro_batches"], c["world_size"]) for c in missed)
        lines.append(f"| {target} | {len(cs) - len(missed)}/{len(cs)} | "
                     f"{'all met' if not missed else 'missed: ' + where} | "
                     f"{pick['profile']}/mb{pick['micro_batches']}/ws{pick['world_size']}: {pick['detail']} |")
    lines.append("")

    # Every row.
    lines += [
        "### Every method, every cell",
        "",
        "| profile | mb | ranks | method | ms median (min-max) | GiB/s | x raw | collectives | follower extra RSS (tensors) | leader extra RSS (tensors) | correct | repeats |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    order = {m: i for i, m in enumerate(CPP_METHODS + PY_METHODS)}
    for r in sorted(rows, key=lambda r: (profile_order(r["profile"]), r["micro_batches"], r["world_size"], order.get(r["method"], 99))):
        if r.get("status") != "ok":
            lines.append(f"| {r['profile']} | {r['micro_batches']} | {r['world_size']} | {LABELS.get(r['method'], r['method'])} "
                         f"| {r.get('status')}: {str(r.get('reason'))[:140]} | | | | | | | |")
            continue
        correct = r.get("correct")
        if correct is None and r.get("impl") == "python":
            correct = True  # python_peers.py reports wrong data as status "error"
        lines.append(
            f"| {r['profile']} | {r['micro_batches']} | {r['world_size']} | {LABELS.get(r['method'], r['method'])} "
            f"| {fmt_ms(r['ms_median'])} ({fmt_ms(r['ms_min'])}-{fmt_ms(r['ms_max'])}) | {r['gib_per_s']:.2f} "
            f"| {r['ratio_to_raw']:.2f} | {'-' if r['collectives'] is None else r['collectives']} | {mem(r, 'follower')} "
            f"| {mem(r, 'leader')} | {'-' if correct is None else 'yes' if correct else 'NO'} | {r['repeats']} |"
            if r.get("ratio_to_raw") is not None else
            f"| {r['profile']} | {r['micro_batches']} | {r['world_size']} | {LABELS.get(r['method'], r['method'])} "
            f"| {fmt_ms(r['ms_median'])} ({fmt_ms(r['ms_min'])}-{fmt_ms(r['ms_max'])}) | {r['gib_per_s']:.2f} | - | {'-' if r['collectives'] is None else r['collectives']} "
            f"| {mem(r, 'follower')} | {mem(r, 'leader')} | {'-' if correct is None else 'yes' if correct else 'NO'} | {r['repeats']} |")
    lines.append("")
    if doc.get("compile"):
        lines += [doc["compile"], ""]
    return "\n".join(lines)


def mem(r: dict, who: str) -> str:
    text = fmt_bytes(r.get(f"{who}_extra_bytes"))
    tensors = r.get(f"{who}_tensor_extra_bytes")
    return text + (f" ({fmt_bytes(tensors)})" if tensors is not None else "")


def profile_order(p):
    order = ["text", "qwen3-vl-image", "interns1-tiles", "qwen3-vl-video-long"]
    return order.index(p) if p in order else 99


def plot(doc: dict, path: pathlib.Path) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        return f"no plot: matplotlib is not importable ({exc!r})"
    rows = [r for r in doc["rows"] if r.get("status") == "ok"]
    cells = sorted({(r["profile"], r["micro_batches"]) for r in rows}, key=lambda c: (profile_order(c[0]), c[1]))
    if not cells:
        return "no plot: no successful rows"
    ncols = len({c[1] for c in cells})
    nrows = (len(cells) + ncols - 1) // ncols
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 3.6 * nrows), squeeze=False)
    styles = {"raw": ("k", "-", "o"), "raw_fresh": ("0.5", "--", "o"), "spbcast": ("tab:red", "-", "s"),
              "spbcast_shm": ("tab:cyan", "-", "*"), "spbcast_shm_alloc": ("tab:olive", "-", "*"),
              "naive": ("tab:blue", "-", "^"), "coalesced": ("tab:green", "-", "v"),
              "pickle": ("tab:purple", ":", "x"), "accelerate": ("tab:orange", ":", "D"),
              "tensordict": ("tab:brown", ":", "P"), "spbcast-py": ("tab:pink", "-", "*")}
    for ax, (profile, mb) in zip(axes.flat, cells):
        payload = next(r["payload_bytes"] for r in rows if r["profile"] == profile and r["micro_batches"] == mb)
        for method in CPP_METHODS + PY_METHODS:
            pts = sorted((r["world_size"], r["ms_median"], r["ms_min"], r["ms_max"]) for r in rows
                         if r["profile"] == profile and r["micro_batches"] == mb and r["method"] == method)
            if not pts:
                continue
            color, ls, marker = styles[method]
            xs = [p[0] for p in pts]
            ax.errorbar(xs, [p[1] for p in pts], yerr=[[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]],
                        color=color, linestyle=ls, marker=marker, markersize=4, capsize=2, linewidth=1.3,
                        label=LABELS[method])
        ax.set_yscale("log")
        ax.set_xticks(sorted({r["world_size"] for r in rows}))
        ax.set_xlabel("ranks (world size)")
        ax.set_ylabel("ms per step (median)")
        ax.set_title(f"{profile}, {mb} micro-batch{'es' if mb > 1 else ''} ({fmt_bytes(payload)})", fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(cells):]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4 if ncols > 1 else 2, fontsize=9, frameon=False)
    m = doc["cpp"]["machine"]
    fig.suptitle(f"spbcast broadcast over loopback Gloo - {m['cpu_model']}, {m['usable_cores']} cores; "
                 f"LibTorch {doc['cpp']['libtorch']['version']}"
                 + (f", PyTorch {doc['python']['torch']}" if doc.get("python") else ""), fontsize=11)
    fig.tight_layout(rect=(0, 0.07 if ncols > 1 else 0.12, 1, 0.97))
    fig.savefig(path, dpi=110)
    return None


# ---------------------------------------------------------------------------------------------

def main(argv=None):
    p = argparse.ArgumentParser(description="Run the C++ grid and the Python peers, merge, check the targets, "
                                            "write results.json, results.md and results.png.")
    p.add_argument("--quick", action="store_true",
                   help="CI: text and qwen3-vl-image, micro-batch 1, 2 ranks, 3 repeats; exit 1 when a check fails")
    p.add_argument("--build", default=None, help="CMake build tree with bench/spbcast_bench (default: build/wheel, else build/system)")
    p.add_argument("--bench", default=None, help="the spbcast_bench binary to run (default: <build>/bench/spbcast_bench)")
    p.add_argument("--label", default=None, help="a note for the table header, e.g. which library patch the binary has")
    p.add_argument("--out", default=None, help="results folder (default: build/bench-results/<full|quick>)")
    p.add_argument("--profiles", default="text,qwen3-vl-image,interns1-tiles,qwen3-vl-video-long")
    p.add_argument("--micro-batches", default="1,4")
    p.add_argument("--world-sizes", default="2,4,8")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--small-repeats", type=int, default=51,
                   help="repeats of cells whose payload is under 1 MiB, whose steps take about a millisecond "
                        "and whose medians need more samples on a shared machine (default: 51)")
    p.add_argument("--big-repeats", type=int, default=-1,
                   help="repeats of cells of --big-mib or more (default: --repeats)")
    p.add_argument("--big-mib", type=int, default=256)
    p.add_argument("--no-python", action="store_true", help="skip the Python peers")
    p.add_argument("--memory-profiles", default="qwen3-vl-image,interns1-tiles,qwen3-vl-video-long",
                   help="profiles of the group-memory measurement ('' skips it)")
    p.add_argument("--memory-micro-batches", type=int, default=1)
    p.add_argument("--python", default=None, help="Python with torch for the peers (default: SPBCAST_PYTHON from the build, else this one)")
    p.add_argument("--compile", action="store_true", help="also measure the compile-time cost (several minutes)")
    p.add_argument("--timeout", type=float, default=6 * 3600, help="seconds for each of the two grids (default: 6 h)")
    p.add_argument("--_plot", nargs=2, help=argparse.SUPPRESS)  # results.json results.png
    p.add_argument("--render-only", action="store_true",
                   help="measure nothing: re-check the targets and rewrite results.md and results.png "
                        "from the results.json in --out")
    args = p.parse_args(argv)
    if args.render_only:
        out = pathlib.Path(args.out or BENCH.parent / "build/bench-results/full").resolve()
        doc = json.loads((out / "results.json").read_text())
        doc["targets"] = all_targets(doc["rows"], doc["cpp"]["config"]["bucket_bytes"], doc.get("group_memory", []))
        if (out / "compile_cost.md").exists():
            doc["compile"] = (out / "compile_cost.md").read_text()
        (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        (out / "results.md").write_text(markdown(doc))
        why = plot(doc, out / "results.png")
        if why:
            print(why, file=sys.stderr)
        print(f"rewrote {out / 'results.md'}", file=sys.stderr)
        return 0
    if args._plot:
        why = plot(json.loads(pathlib.Path(args._plot[0]).read_text()), pathlib.Path(args._plot[1]))
        if why:
            print(why, file=sys.stderr)
        return 1 if why else 0

    if args.quick:
        args.profiles, args.micro_batches, args.world_sizes = "text,qwen3-vl-image", "1", "2"
        args.repeats, args.warmup, args.small_repeats, args.big_repeats = 3, 1, 3, -1
    build = pathlib.Path(args.build).resolve() if args.build else default_build()
    bench = pathlib.Path(args.bench).resolve() if args.bench else build / "bench/spbcast_bench"
    if not bench.exists():
        raise SystemExit(f"{bench} not found: build it first (cmake --build {build} --target spbcast_bench)")
    out = (pathlib.Path(args.out).resolve() if args.out
           else BENCH.parent / "build/bench-results" / ("quick" if args.quick else "full"))
    out.mkdir(parents=True, exist_ok=True)
    python = find_python(args.python, build)
    command = "python bench/report.py " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
    start = time.monotonic()

    # 1. The C++ grid: small cells with more repeats (their steps take about a millisecond).
    cpp_docs = []
    small = [pr for pr in args.profiles.split(",") if pr == "text"]
    other = [pr for pr in args.profiles.split(",") if pr != "text"]
    for part, profiles, repeats in (("small", small, args.small_repeats), ("media", other, args.repeats)):
        if not profiles:
            continue
        path = out / f"cpp-{part}.json"
        cmd = [str(bench), "--world-sizes", args.world_sizes, "--profiles", ",".join(profiles),
               "--micro-batches", args.micro_batches, "--repeats", str(repeats), "--warmup", str(args.warmup),
               "--big-repeats", str(args.big_repeats), "--big-mib", str(args.big_mib), "--json", str(path),
               "--deadline", str(args.timeout)]
        code = run(cmd, out / f"cpp-{part}.log", args.timeout + 600)
        if not path.exists():
            raise SystemExit(f"the C++ benchmark wrote no results (exit {code}); see {out / f'cpp-{part}.log'}")
        cpp_docs.append(json.loads(path.read_text()))
    cpp = dict(cpp_docs[0], results=[r for d in cpp_docs for r in d["results"]],
               commands=[d["config"]["command"] for d in cpp_docs])

    # 2. The Python peers, same grid.
    py = None
    if not args.no_python:
        path = out / "python_peers.json"
        code = run([python, str(BENCH / "python_peers.py"), "--profiles", args.profiles,
                    "--micro-batches", args.micro_batches, "--world-sizes", args.world_sizes,
                    "--repeats", str(args.repeats), "--warmup", str(args.warmup), "--json", str(path)],
                   out / "python_peers.log", args.timeout)
        if path.exists():
            py = json.loads(path.read_text())
        else:
            print(f"python peers wrote no results (exit {code}); see {out / 'python_peers.log'}", file=sys.stderr)

    # 3. Group memory of the same-host path (needs the tests' shm worker from the same build).
    memory = []
    shm_worker = build / "tests/spbcast_shm_worker"
    if args.memory_profiles and not args.quick:
        if shm_worker.exists():
            memory = group_memory(shm_worker, args.memory_profiles.split(","), args.memory_micro_batches,
                                  [int(w) for w in args.world_sizes.split(",")], out, 600)
        else:
            print(f"group memory skipped: {shm_worker} not built", file=sys.stderr)

    # 4. Compile-time cost, on request.
    compile_md = None
    if args.compile:
        run([sys.executable, str(BENCH / "compile_cost.py"), "--build", str(build), "--out", str(out)],
            out / "compile_cost.log", args.timeout)
    if (out / "compile_cost.md").exists():
        compile_md = (out / "compile_cost.md").read_text()

    rows = merge(cpp, py)
    doc = {
        "mode": ("quick" if args.quick else "full") + (f", {args.label}" if args.label else ""),
        "bench": str(bench),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "command": command.strip(),
        "elapsed_s": time.monotonic() - start,
        "platform": platform.platform(),
        "build": str(build),
        "cpp": {k: v for k, v in cpp.items() if k != "results"},
        "python": {k: v for k, v in py.items() if k != "results"} if py else None,
        "rows": rows,
        "group_memory": memory,
        "targets": all_targets(rows, cpp["config"]["bucket_bytes"], memory),
        "compile": compile_md,
    }
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
    (out / "results.md").write_text(markdown(doc))
    why = plot(doc, out / "results.png")
    if why and why.startswith("no plot: matplotlib") and python != sys.executable:
        # This interpreter has no matplotlib; the benchmark's Python (the venv) has.
        done = subprocess.run([python, __file__, "--_plot", str(out / "results.json"), str(out / "results.png")])
        why = None if done.returncode == 0 else why
    if why:
        print(why, file=sys.stderr)
    print(f"wrote {out / 'results.json'}, {out / 'results.md'}" + ("" if why else f", {out / 'results.png'}"), file=sys.stderr)

    for c in doc["targets"]:
        print(f"  {'met   ' if c['met'] else 'MISSED'} {c['target']}: {c['profile']}/mb{c['micro_batches']}/ws{c['world_size']}: {c['detail']}",
              file=sys.stderr)

    if args.quick:
        problems = [f"{r['impl']} {r['method']} {r['profile']}/ws{r['world_size']}: {r.get('status')}: {r.get('reason')}"
                    for r in rows if r.get("impl") == "cpp" and r.get("status") != "ok"]
        problems += [f"python {r['method']} {r['profile']}: {r.get('reason')}" for r in rows
                     if r.get("impl") == "python" and r.get("status") == "error"]
        hard = ("spbcast delivers the root's batch bit-exactly", "<= 2 collectives per step when the payload fits one bucket")
        problems += [f"{c['target']}: {c['profile']}: {c['detail']}" for c in doc["targets"]
                     if c["target"] in hard and not c["met"]]
        if not any(c["target"] == hard[0] for c in doc["targets"]):
            problems.append("no spbcast correctness check ran")
        if problems:
            print("QUICK CHECK FAILED:\n  " + "\n  ".join(problems), file=sys.stderr)
            return 1
        print(f"quick check passed in {doc['elapsed_s']:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
