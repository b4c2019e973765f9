#!/usr/bin/env python3
"""What spbcast.energon costs and saves a training step: Megatron-Energon's own savable loader in a
training loop, BASE (Energon as shipped: every rank of a TP group runs it) against dedup
(``spbcast.energon.get_savable_loader(..., group=tp_group)``: only the TP leader runs it, the
default prefetch), at TP2 x DP2 and TP4 on 4 ranks, side by side in one run.

The data: a captioning WebDataset of JPEG images (--image pixels square, smooth random patterns)
and captions in tar shards, prepared by ``energon prepare`` in a temporary directory; each rank
builds Energon's ``get_train_dataset`` with ``WorkerConfig(rank=dp_rank, world_size=dp,
num_workers=--workers, data_parallel_group=...)``, whose default decoder turns each image into a
float32 RGB tensor in the workers, and Energon's default batching stacks them. The step sleeps (a
GPU-bound step leaves the CPU idle), then all-reduces a small tensor over the world and the
batch's page-strided checksum over the TP group (the TP ranks must have had the same batch). The
arms run in the same processes, interleaved round after round, each with a new dataset and
loader (and Energon's worker processes).

Per arm: the step time (the slowest rank's, from the end of one step to the end of the next;
the median over the measured steps, a round's first --warmup steps not measured); what the
followers waited in next(); and per role - TP leader, follower - the host memory of a rank (the
proportional set size, anonymous plus shared memory, of its process and its Energon worker
processes, at the end of the measured steps) and its CPU time per step (its process and its
workers, over the measured steps).

  ~/.cache/spbcast/venv/bin/python bench/energon_step.py            # ~4 min here
  ~/.cache/spbcast/venv/bin/python bench/energon_step.py --quick    # ~1 min
Prints the markdown table; writes it and the JSON of every rank's steps to --out
(bench/results/energon_step/; the JSON is git-ignored).
"""

import argparse
import datetime
import io
import json
import os
import statistics
import sys
import tarfile
import tempfile
import time

import torch
import torch.distributed as dist

from step_overhead import (USAGE_HEADER, USAGE_NOTE, MiB, checksum, loader_fields, loadavg, machine, machine_line,
                           spawn_ranks, usage, next_ms_mean, slowest_step_times, usage_by_role, usage_cells,
                           write_results)

WORLD = 4
SETTINGS = {"tp2": {"name": "TP2 x DP2", "tp": 2}, "tp4": {"name": "TP4", "tp": 4}}
ARMS = ({"name": "base", "dedup": False}, {"name": "dedup", "dedup": True})


# ---- the data ----------------------------------------------------------------------------------

def write_dataset(root, image, shards, per_shard):
    """JPEG captioning samples in tar shards, prepared by ``energon prepare`` (non-interactive)."""
    import numpy as np
    from megatron.energon.tools.prepare import command as energon_prepare
    from PIL import Image

    rng = np.random.default_rng(0)
    for shard in range(shards):
        with tarfile.open(os.path.join(root, f"part-{shard:03d}.tar"), "w") as tar:
            for i in range(per_shard):
                pattern = Image.fromarray(rng.integers(0, 256, (24, 24, 3), dtype=np.uint8))
                jpeg = io.BytesIO()
                pattern.resize((image, image), Image.BICUBIC).save(jpeg, format="JPEG", quality=90)
                members = {"jpg": jpeg.getvalue(), "txt": f"sample {shard}-{i}".encode()}
                for ext, payload in members.items():
                    member = tarfile.TarInfo(f"{shard:03d}{i:05d}.{ext}")
                    member.size = len(payload)
                    tar.addfile(member, io.BytesIO(payload))
    energon_prepare.main([root, "--non-interactive", "--split-ratio", "1,0,0", "--sample-type",
                          "CaptioningSample", "--field-map", '{"image": "jpg", "caption": "txt"}'],
                         standalone_mode=False)


# ---- one rank ----------------------------------------------------------------------------------

def run_arm(arm, cfg, data, tp, tp_group, dp_group, rank):
    import spbcast.energon
    from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

    torch.manual_seed(1)
    dp_rank, dp = rank // tp, WORLD // tp
    config = WorkerConfig(rank=dp_rank, world_size=dp, num_workers=cfg["workers"],
                          data_parallel_group=dp_group)
    dataset = get_train_dataset(data, worker_config=config, batch_size=cfg["batch_size"],
                                shuffle_buffer_size=16, max_samples_per_sequence=8)
    if arm["dedup"]:
        loader = spbcast.energon.get_savable_loader(dataset, group=tp_group)
    else:
        loader = get_savable_loader(dataset)
    steps, mismatches, before, after = [], 0, None, None
    batches = iter(loader)
    dist.barrier()
    last = time.monotonic()
    for i in range(cfg["warmup"] + cfg["steps"]):
        asked = time.monotonic()
        batch = next(batches)
        got = time.monotonic()
        mine = checksum({"image": batch.image})
        time.sleep(cfg["step_seconds"])  # the GPU's part of the step
        dist.all_reduce(torch.ones(256))  # the gradients' all-reduce stand-in
        seen = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=tp_group)
        mismatches += int(seen[0] != -seen[1])
        end = time.monotonic()
        steps.append({"next": got - asked, "step": end - last, "mib": batch.image.nbytes / MiB})
        last = end
        del batch
        if i == cfg["warmup"] - 1:
            before = usage()
    after = usage()
    stats = loader.stats() if arm["dedup"] else None
    if arm["dedup"]:
        loader.close()
    else:  # torch-internal: Energon's loader has no close(); its persistent workers' iterator
        loader._iterator._shutdown_workers()
    return {"arm": arm["name"], "rank": rank, "leader": rank % tp == 0, "steps": steps,
            "mismatches": mismatches, "mib": after["mib"],
            "cpu_s_per_step": (after["cpu_s"] - before["cpu_s"]) / cfg["steps"],
            **loader_fields(stats)}


def rank_main(rank, world, init_file, cfg, setting, data, out_dir):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    tp = setting["tp"]
    groups = {}
    for kind, members in (("tp", [list(range(g, g + tp)) for g in range(0, world, tp)]),
                          ("dp", [list(range(t, world, tp)) for t in range(tp)])):
        for ranks in members:  # every rank creates every group, in one order
            group = dist.new_group(ranks)
            if rank in ranks:
                groups[kind] = group
    records = []
    for r in range(cfg["rounds"]):
        for arm in ARMS:
            record = run_arm(arm, cfg, data, tp, groups["tp"], groups["dp"], rank)
            record["round"] = r
            records.append(record)
            if rank == 0:
                times = sorted(s["step"] for s in record["steps"][cfg["warmup"]:])
                print(f"  {setting['name']} round {r} {arm['name']}: median {statistics.median(times):.3f} s",
                      flush=True)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    dist.destroy_process_group()


# ---- the table ---------------------------------------------------------------------------------

def summarize(setting, cfg, records):
    rows = []
    for arm in ARMS:
        mine = [r for r in records if r["arm"] == arm["name"]]
        times = slowest_step_times(mine, cfg)
        leaders = [r for r in mine if r["leader"]]
        followers = [r for r in mine if not r["leader"]]
        rows.append({
            "setting": setting["name"], "arm": arm["name"], "path": mine[0]["path"],
            "prefetch": mine[0]["prefetch"], "median_step_s": statistics.median(times),
            "batch_mib": mine[0]["steps"][0]["mib"],
            "follower_next_ms_mean": next_ms_mean(followers, cfg),
            **usage_by_role(mine, leaders, followers, cfg["rounds"]),
            "tp_batches_equal": all(r["mismatches"] == 0 for r in mine)})
    rows[1]["x_base"], rows[0]["x_base"] = rows[1]["median_step_s"] / rows[0]["median_step_s"], 1.0
    return rows


def markdown(result):
    cfg = result["config"]
    lines = [f"Command: `{result['command']}`", "",
             machine_line(result, f"megatron-energon {result['energon']}, "), "",
             f"4 ranks; batches of {cfg['batch_size']} {cfg['image']} x {cfg['image']} JPEG images decoded "
             f"to float32 by Energon's {cfg['workers']} workers per loader; a {cfg['step_seconds']} s step then "
             f"all-reduces; {cfg['rounds']} rounds x {cfg['steps']} measured steps per arm ({cfg['warmup']} "
             "warm-up steps a round). " + USAGE_NOTE, "",
             "| setting | arm | path | prefetch | batch (MiB) | median step (s) | x BASE | followers: next() "
             "mean (ms) " + USAGE_HEADER + "| TP batches equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(
            f"| {row['setting']} | {row['arm']} | {row['path']} | {row['prefetch'] or '-'} "
            f"| {row['batch_mib']:.1f} | {row['median_step_s']:.3f} | {row['x_base']:.3f} "
            f"| {row['follower_next_ms_mean']:.1f} " + usage_cells(row)
            + f"| {'yes' if row['tp_batches_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 px images, 0.2 s steps, 1 round of 4 steps")
    parser.add_argument("--image", type=int, help="image side in pixels (default 768; quick 256)")
    parser.add_argument("--batch-size", type=int, default=4, help="images per batch (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="Energon workers per loader (default 2)")
    parser.add_argument("--step-seconds", type=float, help="the step's sleep (default 0.5; quick 0.2)")
    parser.add_argument("--steps", type=int, help="measured steps per arm and round (default 12; quick 4)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per arm and round (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds, each running both arms (default 2; quick 1)")
    parser.add_argument("--settings", default="tp2,tp4", help="comma-separated: tp2 (TP2 x DP2), tp4")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per setting before giving up")
    parser.add_argument("--out", default=os.path.join(here, "results", "energon_step"),
                        help="directory for the JSON and markdown (default bench/results/energon_step)")
    args = parser.parse_args()
    q = args.quick
    cfg = {"image": args.image or (256 if q else 768), "batch_size": args.batch_size, "workers": args.workers,
           "step_seconds": args.step_seconds if args.step_seconds is not None else (0.2 if q else 0.5),
           "steps": args.steps or (4 if q else 12), "warmup": args.warmup or (2 if q else 3),
           "rounds": args.rounds or (1 if q else 2)}
    chosen = [s.strip() for s in args.settings.split(",") if s.strip()]
    for s in chosen:
        if s not in SETTINGS:
            parser.error(f"unknown setting {s!r}")
    import megatron.energon
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = {"command": " ".join(["bench/energon_step.py"] + sys.argv[1:]), "machine": machine(),
              "energon": megatron.energon.__version__, "date": datetime.date.today().isoformat(),
              "load_before": loadavg(), "config": cfg, "records": {}, "rows": []}
    print(f"energon_step: {result['machine']}, load {result['load_before']}, {cfg}", flush=True)
    with tempfile.TemporaryDirectory(prefix="spbcast-energon-step.") as data:
        write_dataset(data, cfg["image"], shards=4, per_shard=16)
        for key in chosen:
            setting = SETTINGS[key]
            records = spawn_ranks(rank_main, lambda init_file, out_dir: (WORLD, init_file, cfg, setting,
                                                                         data, out_dir),
                                  args.timeout, setting["name"])
            result["records"][setting["name"]] = records
            result["rows"] += summarize(setting, cfg, records)
    result.update(load_after=loadavg(), minutes=(time.monotonic() - started) / 60)
    write_results(args.out, "energon_step-quick" if q else "energon_step", result, markdown(result))
    return 0 if all(r["tp_batches_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
