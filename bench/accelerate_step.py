#!/usr/bin/env python3
"""What spbcast.accelerate costs a training step: accelerate's own prepared DataLoader in a training
loop, BASE (accelerate as shipped: every rank loads) against dedup (``spbcast.accelerate.enable``:
only the TP leaders load, the default prefetch), side by side in one run.

4 spawned Gloo ranks with the device mesh (dp_shard 2, tp 2) given to the accelerator (accelerate
refuses TP on a CPU-only run, so the mesh is set and nothing else changes), each preparing a
torch.utils.data.DataLoader with persistent workers over bench/step_overhead.py's deterministic
samples (a dict of large uint8 and float32 tensors, a RandomSampler) with ``accelerator.prepare``;
the step sleeps (a GPU-bound step leaves the CPU idle), then all-reduces a small tensor over the
world and the batch's page-strided checksum over the TP group (MAX of it and of its negation: the
TP ranks must have had the same batch). The arms run in the same processes, interleaved round
after round. The step time is the slowest rank's, from the end of one step to the end of the next;
per arm the median over the measured steps (a round's first --warmup steps are not measured).

  ~/.cache/spbcast/venv/bin/python bench/accelerate_step.py            # ~3 min here
  ~/.cache/spbcast/venv/bin/python bench/accelerate_step.py --quick    # ~1 min
Prints the markdown table; writes it and the JSON of every rank's steps to --out
(bench/results/accelerate_step/; the JSON is git-ignored).
"""

import argparse
import datetime
import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from step_overhead import (MiB, Samples, add_loop_options, checksum, loadavg, loop_config, machine,
                           machine_line, next_ms_mean, slowest_step_times, spawn_ranks, write_results)

WORLD = 4
MESH = (("dp_shard", 2), ("tp", 2))
ARMS = ({"name": "base", "dedup": False}, {"name": "dedup", "dedup": True})


def run_arm(arm, cfg, mesh, rank):
    import spbcast.accelerate
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)  # a new run in the same process
    GradientState._reset_state()
    accelerator = Accelerator(cpu=True)
    accelerator.state.device_mesh = mesh
    if arm["dedup"]:
        spbcast.accelerate.enable(accelerator)
    torch.manual_seed(1)
    total = cfg["warmup"] + cfg["steps"]
    data_indices = WORLD // dict(MESH)["tp"]
    dataset = Samples(cfg["batch_size"] * data_indices * total,  # one pass: exactly the steps
                      cfg["batch_bytes"] // cfg["batch_size"])
    loader = accelerator.prepare(torch.utils.data.DataLoader(
        dataset, batch_size=cfg["batch_size"], shuffle=True, num_workers=cfg["workers"],
        persistent_workers=True, multiprocessing_context="fork"))
    tp_group = mesh["tp"].get_group()
    steps, mismatches = [], 0
    dist.barrier()
    last = asked = time.monotonic()
    for i, batch in enumerate(loader):
        got = time.monotonic()
        mine = checksum(batch)
        time.sleep(cfg["step_seconds"])  # the GPU's part of the step
        dist.all_reduce(torch.ones(256))  # the gradients' all-reduce stand-in
        seen = torch.tensor([mine, -mine], dtype=torch.int64)
        dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=tp_group)
        mismatches += int(seen[0] != -seen[1])
        end = time.monotonic()
        steps.append({"next": got - asked, "step": end - last})
        del batch
        last = asked = end
    stats = spbcast.accelerate.stats(loader)
    # The accelerator and its loaders hold each other: collected here, not in a DataLoader worker
    # the next arm forks (where the iterator's __del__ would stop workers that are not its children).
    del loader, accelerator
    gc.collect()
    return {"arm": arm["name"], "rank": rank, "steps": steps, "mismatches": mismatches, "stats": stats}


def rank_main(rank, world, init_file, cfg, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", tuple(s for _, s in MESH), mesh_dim_names=tuple(n for n, _ in MESH))
    records = []
    for r in range(cfg["rounds"]):
        for arm in ARMS:
            record = run_arm(arm, cfg, mesh, rank)
            record["round"] = r
            records.append(record)
            if rank == 0:
                times = sorted(s["step"] for s in record["steps"][cfg["warmup"]:])
                print(f"  round {r} {arm['name']}: median {statistics.median(times):.3f} s", flush=True)
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(records, f)
    dist.destroy_process_group()


def summarize(cfg, records):
    rows = []
    for arm in ARMS:
        mine = [r for r in records if r["arm"] == arm["name"]]
        times = slowest_step_times(mine, cfg)
        followers = [r for r in mine if r["rank"] % dict(MESH)["tp"] != 0]
        stats = mine[0]["stats"]
        rows.append({"arm": arm["name"], "median_step_s": statistics.median(times),
                     "measured_steps": len(times),
                     "prefetch": stats["prefetch"] if stats else "-", "path": stats["path"] if stats else "local",
                     "follower_next_ms_mean": next_ms_mean(followers, cfg),
                     "tp_batches_equal": all(r["mismatches"] == 0 for r in mine)})
    for row in rows:
        row["x_base"] = row["median_step_s"] / rows[0]["median_step_s"]
    return rows


def markdown(result):
    cfg = result["config"]
    lines = [f"Command: `{result['command']}`", "",
             machine_line(result, f"accelerate {result['accelerate']}, "), "",
             f"4 ranks, mesh (dp_shard 2, tp 2); a {cfg['batch_bytes'] / MiB:.0f} MiB batch "
             f"({cfg['batch_size']} samples) from a DataLoader with {cfg['workers']} persistent workers "
             f"prepared by accelerate; a {cfg['step_seconds']} s step then all-reduces; {cfg['rounds']} "
             f"rounds x {cfg['steps']} measured steps per arm ({cfg['warmup']} warm-up steps a round).", "",
             "| arm | path | prefetch | median step (s) | x BASE | followers: next() mean (ms) | TP batches equal |",
             "|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(f"| {row['arm']} | {row['path']} | {row['prefetch']} | {row['median_step_s']:.3f} "
                     f"| {row['x_base']:.3f} | {row['follower_next_ms_mean']:.1f} "
                     f"| {'yes' if row['tp_batches_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main():
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_loop_options(parser, rounds=3)
    parser.add_argument("--timeout", type=float, default=1200, help="seconds before giving up")
    parser.add_argument("--out", default=os.path.join(here, "results", "accelerate_step"),
                        help="directory for the JSON and markdown (default bench/results/accelerate_step)")
    args = parser.parse_args()
    cfg = loop_config(args)
    import accelerate
    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = {"command": " ".join(["bench/accelerate_step.py"] + sys.argv[1:]), "machine": machine(),
              "accelerate": accelerate.__version__, "date": datetime.date.today().isoformat(),
              "load_before": loadavg(), "config": cfg}
    print(f"accelerate_step: {result['machine']}, load {result['load_before']}, {cfg}", flush=True)
    records = spawn_ranks(rank_main, lambda init_file, out_dir: (WORLD, init_file, cfg, out_dir),
                          args.timeout, "accelerate_step")
    result.update(records=records, rows=summarize(cfg, records), load_after=loadavg(),
                  minutes=(time.monotonic() - started) / 60)
    write_results(args.out, "accelerate_step-quick" if args.quick else "accelerate_step", result,
                  markdown(result))
    return 0 if all(r["tp_batches_equal"] for r in result["rows"][1:]) else 1


if __name__ == "__main__":
    sys.exit(main())
