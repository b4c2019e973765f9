#!/usr/bin/env python3
"""What spbcast.swift costs and saves a training step: ms-swift's own SP train loader in a training
loop, BASE (ms-swift as shipped: both ranks of an SP group encode every sample) against dedup
(``spbcast.swift.enable()``: only the SP leader encodes, the default prefetch), at SP2 x DP2 on 4
ranks.

Each rank runs ms-swift's ``swift sft`` pipeline (python/tests/swift_ranks.py: a tiny Qwen2-VL
built from a config, nothing downloaded) over image-and-text samples - --image pixels square PNG
files, which ms-swift's LazyLLMDataset encodes with the Qwen2-VL template (qwen_vl_utils' fetch,
the image processor) in the DataLoader workers - and iterates the trainer's own SP train loader
(``get_train_dataloader``: SequenceParallelSampler, workers seeded by data rank). The step sleeps
(a GPU-bound step leaves the CPU idle), then all-reduces a small tensor over the world and the
batch's page-strided checksum over the SP group (the SP ranks must have had the same batch).
enable() is process-wide, so each arm runs in its own 4 processes, arm after arm, round after
round.

Per arm: the step time (the slowest rank's, from the end of one step to the end of the next; the
median over the measured steps, a round's first --warmup steps not measured); what the followers
waited in next(); and per role - SP leader, follower - the host memory of a rank (Pss_Anon +
Pss_Shmem of its process and its DataLoader workers, at the end of the measured steps) and its CPU
time per step (its process and its workers, over the measured steps).

  ~/.cache/spbcast/venv-swift/bin/python bench/swift_step.py            # ~4 min here
  ~/.cache/spbcast/venv-swift/bin/python bench/swift_step.py --quick    # ~2 min
Prints the markdown table; writes it and the JSON of every rank's steps to --out
(bench/results/swift_step/; the JSON is git-ignored).
"""

import argparse
import datetime
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from step_overhead import (USAGE_HEADER, USAGE_NOTE, MiB, checksum, loadavg, machine, machine_line, spawn_ranks, usage,
                           next_ms_mean, slowest_step_times, usage_by_role, usage_cells, write_results)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "python", "tests")
WORLD, SP = 4, 2
ARMS = ({"name": "base", "dedup": False}, {"name": "dedup", "dedup": True})


def run_arm(arm, cfg, data, rank):
    import spbcast.swift
    import swift_ranks as sr
    from swift.pipelines.train.sft import SwiftSft
    from swift.sequence_parallel import sequence_parallel

    total = cfg["warmup"] + cfg["steps"]
    record = {"arm": arm["name"], "rank": rank, "steps": [], "mismatches": 0}

    def loop(trainer):
        loader = trainer.get_train_dataloader()
        sp_group = sequence_parallel.sp_group
        dist.barrier()
        last = asked = time.monotonic()
        for i, batch in enumerate(loader):
            got = time.monotonic()
            if i == cfg["warmup"]:
                record["before"] = usage()
            mine = checksum(batch)
            time.sleep(cfg["step_seconds"])  # the GPU's part of the step
            dist.all_reduce(torch.ones(256))  # the gradients' all-reduce stand-in
            seen = torch.tensor([mine, -mine], dtype=torch.int64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=sp_group)
            record["mismatches"] += int(seen[0] != -seen[1])
            end = time.monotonic()
            record["steps"].append({"next": got - asked, "step": end - last,
                                    "mib": sum(t.numel() * t.element_size() for t in batch.values()
                                               if isinstance(t, torch.Tensor)) / MiB})
            if i + 1 == total:
                after = usage()
                record.update(mib=after["mib"],
                              cpu_s_per_step=(after["cpu_s"] - record["before"]["cpu_s"]) / cfg["steps"])
                break
            last = asked = end
        stats = spbcast.swift.stats(loader)
        record.update(prefetch=stats["prefetch"] if stats else None, path=stats["path"] if stats else "local")

    if arm["dedup"]:
        spbcast.swift.enable()
    pipeline = SwiftSft(sr.sft_arguments(sr.Arm(arm["name"], arm["dedup"], workers=cfg["workers"],
                                                batch_size=cfg["batch_size"], max_steps=total,
                                                save_steps=10 * total), data))
    pipeline.train = loop
    pipeline.main()
    return record


def rank_main(rank, world, init_file, cfg, arm, round_, data, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT="1")
    torch.set_num_threads(1)
    # As under torchrun: DataLoader workers fork (a spawned rank would spawn them, and ms-swift's
    # pickled template, without its model, would load the model again in each worker).
    multiprocessing.set_start_method("fork", force=True)
    sys.path.insert(0, TESTS)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    import swift_ranks as sr

    sr.IMAGE_MAX_PIXELS["value"] = cfg["image"] * cfg["image"]
    record = run_arm(arm, cfg, data, rank)
    record["round"] = round_
    dist.barrier()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump([record], f)
    dist.destroy_process_group()


def summarize(cfg, records):
    rows = []
    for arm in ARMS:
        mine = [r for r in records if r["arm"] == arm["name"]]
        times = slowest_step_times(mine, cfg)
        leaders = [r for r in mine if r["rank"] % SP == 0]
        followers = [r for r in mine if r["rank"] % SP != 0]
        rows.append({
            "arm": arm["name"], "path": mine[0]["path"], "prefetch": mine[0]["prefetch"],
            "median_step_s": statistics.median(times), "batch_mib": mine[0]["steps"][0]["mib"],
            "follower_next_ms_mean": next_ms_mean(followers, cfg),
            **usage_by_role(mine, leaders, followers, cfg["rounds"]),
            "sp_batches_equal": all(r["mismatches"] == 0 for r in mine)})
    for row in rows:
        row["x_base"] = row["median_step_s"] / rows[0]["median_step_s"]
    return rows


def markdown(result):
    cfg = result["config"]
    lines = [f"Command: `{result['command']}`", "",
             machine_line(result, f"ms-swift {result['swift']}, "), "",
             f"4 ranks, SP2 x DP2; batches of {cfg['batch_size']} samples, each a {cfg['image']} x "
             f"{cfg['image']} PNG image and text that ms-swift's Qwen2-VL template encodes in "
             f"{cfg['workers']} DataLoader workers per rank; a {cfg['step_seconds']} s step then all-reduces; "
             f"{cfg['rounds']} rounds x {cfg['steps']} measured steps per arm ({cfg['warmup']} warm-up steps "
             "a round). " + USAGE_NOTE, "",
             "| arm | path | prefetch | batch (MiB) | median step (s) | x BASE | followers: next() mean (ms) "
             + USAGE_HEADER + "| SP batches equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(
            f"| {row['arm']} | {row['path']} | {row['prefetch'] or '-'} | {row['batch_mib']:.1f} "
            f"| {row['median_step_s']:.3f} | {row['x_base']:.3f} | {row['follower_next_ms_mean']:.1f} "
            + usage_cells(row) + f"| {'yes' if row['sp_batches_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="224 px images, 0.2 s steps, 1 round of 4 steps")
    parser.add_argument("--image", type=int, help="image side in pixels, a multiple of 28 (default 448; quick 224)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default 4)")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--step-seconds", type=float, help="the step's sleep (default 0.5; quick 0.2)")
    parser.add_argument("--steps", type=int, help="measured steps per arm and round (default 12; quick 4)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per arm and round (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds, each running both arms (default 2; quick 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per arm before giving up")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "swift_step"),
                        help="directory for the JSON and markdown (default bench/results/swift_step)")
    args = parser.parse_args()
    q = args.quick
    cfg = {"image": args.image or (224 if q else 448), "batch_size": args.batch_size, "workers": args.workers,
           "step_seconds": args.step_seconds if args.step_seconds is not None else (0.2 if q else 0.5),
           "steps": args.steps or (4 if q else 12), "warmup": args.warmup or (2 if q else 3),
           "rounds": args.rounds or (1 if q else 2)}
    if cfg["image"] % 28:
        parser.error("--image must be a multiple of 28 (Qwen2-VL's patch 14 x merge 2)")
    sys.path.insert(0, TESTS)
    import swift
    import swift_ranks as sr

    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = {"command": " ".join(["bench/swift_step.py"] + sys.argv[1:]), "machine": machine(),
              "swift": swift.__version__, "date": datetime.date.today().isoformat(),
              "load_before": loadavg(), "config": cfg, "records": []}
    print(f"swift_step: {result['machine']}, load {result['load_before']}, {cfg}", flush=True)
    with tempfile.TemporaryDirectory(prefix="spbcast-swift-step.") as data:
        os.makedirs(os.path.join(data, "data"))
        sr.write_model(os.path.join(data, "model"))
        # One pass of the loader: the steps and 2 more (the leader's workers are still there, and
        # counted, when the last measured step ends).
        steps = cfg["warmup"] + cfg["steps"] + 2
        sr.write_dataset(os.path.join(data, "data"), n=cfg["batch_size"] * (WORLD // SP) * steps, side=cfg["image"])
        for round_ in range(cfg["rounds"]):
            for arm in ARMS:
                records = spawn_ranks(rank_main, lambda init_file, out_dir: (WORLD, init_file, cfg, arm, round_,
                                                                             data, out_dir),
                                      args.timeout, f"swift_step {arm['name']}")
                result["records"] += records
                times = sorted(s["step"] for s in records[0]["steps"][cfg["warmup"]:])
                print(f"  round {round_} {arm['name']}: median {statistics.median(times):.3f} s", flush=True)
    result.update(rows=summarize(cfg, result["records"]), load_after=loadavg(),
                  minutes=(time.monotonic() - started) / 60)
    write_results(args.out, "swift_step-quick" if q else "swift_step", result, markdown(result))
    return 0 if all(r["sp_batches_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
