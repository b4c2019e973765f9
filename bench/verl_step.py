#!/usr/bin/env python3
"""What spbcast.verl costs and saves a training step: verl's own SFT train loader in verl's own
``fit()`` loop, BASE (verl as shipped: both ranks of an SP group read and tokenize every sample)
against dedup (``spbcast.verl.enable()``: only the SP leader reads, the default prefetch), at dp 2
x Ulysses sp 2 on 4 ranks.

Each rank runs verl 0.9.1's ``SFTTrainer`` (python/tests/verl_ranks.py: its MultiTurnSFTDataset
over a parquet file of multi-turn conversations, the no_padding collator's jagged nested tensors,
its StatefulDataLoader with DataLoader workers, ``fit()``; the model engine stood in for, as the
test does). The engine's step sleeps (a GPU-bound step leaves the CPU idle), then all-reduces a
small tensor over the world and the batch's checksum over the SP group (the SP ranks must have had
the same batch). enable() is process-wide, so each arm runs in its own 4 processes, arm after arm,
round after round.

Per arm: the step time (the slowest rank's; the median over the measured steps, a round's first
--warmup steps not measured); what the followers spent between steps (fit() waiting for the batch and building its TensorDict); and per role - SP
leader, follower - the host memory of a rank (Pss_Anon + Pss_Shmem of its process and its
DataLoader workers, at the end of the measured steps) and its CPU time per step.

  ~/.cache/spbcast/venv-verl/bin/python bench/verl_step.py            # ~2 min here
  ~/.cache/spbcast/venv-verl/bin/python bench/verl_step.py --quick    # ~1 min
Prints the markdown table; writes it and the JSON of every rank's steps to --out
(bench/results/verl_step/; the JSON is git-ignored).
"""

import argparse
import datetime
import hashlib
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from step_overhead import (USAGE_HEADER, USAGE_NOTE, loadavg, machine, machine_line, next_ms_mean, slowest_step_times,
                           spawn_ranks, usage, usage_by_role, usage_cells, write_results)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "python", "tests")
WORLD, SP = 4, 2
ARMS = ({"name": "base", "dedup": False}, {"name": "dedup", "dedup": True})


def run_arm(arm, cfg, data, rank):
    import spbcast.verl
    import verl_ranks as vr

    total = cfg["warmup"] + cfg["steps"]
    record = {"arm": arm["name"], "rank": rank, "steps": [], "mismatches": 0}
    clock = {"last": None}

    class SteppingEngine(vr._StandInEngine):
        def train_batch(self, data):
            got = time.monotonic()
            i = len(record["steps"])
            if i == cfg["warmup"]:
                record["before"] = usage()
            mine = int(hashlib.sha256(repr(vr.digest(data)).encode()).hexdigest()[:15], 16)
            time.sleep(cfg["step_seconds"])  # the GPU's part of the step
            dist.all_reduce(torch.ones(256))  # the gradients' all-reduce stand-in
            seen = torch.tensor([mine, -mine], dtype=torch.int64)
            dist.all_reduce(seen, op=dist.ReduceOp.MAX, group=self.ulysses_device_mesh["sp"].get_group())
            record["mismatches"] += int(seen[0] != -seen[1])
            end = time.monotonic()
            last = clock["last"] if clock["last"] is not None else got
            record["steps"].append({"next": got - last - 0.0, "step": end - last})
            clock["last"] = end
            if i + 1 == total:
                after = usage()
                record.update(mib=after["mib"],
                              cpu_s_per_step=(after["cpu_s"] - record["before"]["cpu_s"]) / cfg["steps"])
            return super().train_batch(data)

    class Trainer(vr.RecordingSFTTrainer):
        def _build_engine(self):
            self.training_client = self.engine = SteppingEngine(SP)

    if arm["dedup"]:
        spbcast.verl.enable()
    trainer = Trainer(vr.config(vr.Arm(arm["name"], arm["dedup"], workers=cfg["workers"], steps=total,
                                       save_freq=10 * total), data))
    dist.barrier()
    trainer.fit()
    stats = spbcast.verl.stats(trainer.train_dataloader)
    record.update(prefetch=stats["prefetch"] if stats else None, path=stats["path"] if stats else "local")
    return record


def rank_main(rank, world, init_file, cfg, arm, round_, data, out_dir):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    torch.set_num_threads(1)
    multiprocessing.set_start_method("fork", force=True)  # DataLoader workers fork, as under torchrun
    sys.path.insert(0, TESTS)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
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
        leaders = [r for r in mine if r["rank"] % SP == 0]
        followers = [r for r in mine if r["rank"] % SP != 0]
        rows.append({
            "arm": arm["name"], "path": mine[0]["path"], "prefetch": mine[0]["prefetch"],
            "median_step_s": statistics.median(slowest_step_times(mine, cfg)),
            "follower_next_ms_mean": next_ms_mean(followers, cfg),
            **usage_by_role(mine, leaders, followers, cfg["rounds"]),
            "sp_batches_equal": all(r["mismatches"] == 0 for r in mine)})
    for row in rows:
        row["x_base"] = row["median_step_s"] / rows[0]["median_step_s"]
    return rows


def markdown(result):
    cfg = result["config"]
    lines = [f"Command: `{result['command']}`", "",
             machine_line(result, f"verl {result['verl']}, "), "",
             f"4 ranks, dp 2 x sp 2; batches of {cfg['batch_size']} multi-turn conversations per dp rank "
             f"({cfg['turns']} turns of {cfg['words']} words) that verl's MultiTurnSFTDataset tokenizes in "
             f"{cfg['workers']} DataLoader workers per rank, collated to jagged nested tensors; a "
             f"{cfg['step_seconds']} s step then all-reduces; {cfg['rounds']} rounds x {cfg['steps']} measured "
             f"steps per arm ({cfg['warmup']} warm-up steps a round). " + USAGE_NOTE, "",
             "| arm | path | prefetch | median step (s) | x BASE | followers: between steps, mean (ms) "
             + USAGE_HEADER + "| SP batches equal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in result["rows"]:
        lines.append(
            f"| {row['arm']} | {row['path']} | {row['prefetch'] or '-'} | {row['median_step_s']:.3f} "
            f"| {row['x_base']:.3f} | {row['follower_next_ms_mean']:.1f} "
            + usage_cells(row) + f"| {'yes' if row['sp_batches_equal'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def write_dataset(directory, n, turns, words, seed=3):
    """Conversations of ``turns`` user/assistant turn pairs of ``words`` words each."""
    import numpy as np
    import pandas as pd

    rng = np.random.RandomState(seed)

    def text():
        return " ".join(f"w{j}" for j in rng.randint(0, 64, words))

    rows = [{"messages": [m for _ in range(turns) for m in ({"role": "user", "content": text()},
                                                             {"role": "assistant", "content": text()})]}
            for _ in range(n)]
    pd.DataFrame(rows).to_parquet(os.path.join(directory, "train.parquet"))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="0.2 s steps, 1 round of 4 steps")
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank (default 2)")
    parser.add_argument("--turns", type=int, default=8, help="turn pairs per conversation (default 8)")
    parser.add_argument("--words", type=int, default=12, help="words per turn (default 12)")
    parser.add_argument("--step-seconds", type=float, help="the step's sleep (default 0.5; quick 0.2)")
    parser.add_argument("--steps", type=int, help="measured steps per arm and round (default 12; quick 4)")
    parser.add_argument("--warmup", type=int, help="warm-up steps per arm and round (default 3; quick 2)")
    parser.add_argument("--rounds", type=int, help="rounds, each running both arms (default 2; quick 1)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per arm before giving up")
    parser.add_argument("--out", default=os.path.join(HERE, "results", "verl_step"),
                        help="directory for the JSON and markdown (default bench/results/verl_step)")
    args = parser.parse_args()
    q = args.quick
    cfg = {"batch_size": 3, "workers": args.workers, "turns": args.turns, "words": args.words,
           "step_seconds": args.step_seconds if args.step_seconds is not None else (0.2 if q else 0.5),
           "steps": args.steps or (4 if q else 12), "warmup": args.warmup or (2 if q else 3),
           "rounds": args.rounds or (1 if q else 2)}
    sys.path.insert(0, TESTS)
    import verl
    import verl_ranks as vr

    os.makedirs(args.out, exist_ok=True)
    started = time.monotonic()
    result = {"command": " ".join(["bench/verl_step.py"] + sys.argv[1:]), "machine": machine(),
              "verl": verl.__version__, "date": datetime.date.today().isoformat(),
              "load_before": loadavg(), "config": cfg, "records": []}
    print(f"verl_step: {result['machine']}, load {result['load_before']}, {cfg}", flush=True)
    with tempfile.TemporaryDirectory(prefix="spbcast-verl-step.") as data:
        os.makedirs(os.path.join(data, "data"))
        vr.write_model(os.path.join(data, "model"))
        # One pass of the loader: the steps and 2 more.
        steps = cfg["warmup"] + cfg["steps"] + 2
        write_dataset(os.path.join(data, "data"), cfg["batch_size"] * (WORLD // SP) * steps, cfg["turns"], cfg["words"])
        for round_ in range(cfg["rounds"]):
            for arm in ARMS:
                records = spawn_ranks(rank_main, lambda init_file, out_dir: (WORLD, init_file, cfg, arm, round_,
                                                                             data, out_dir),
                                      args.timeout, f"verl_step {arm['name']}")
                result["records"] += records
                times = sorted(s["step"] for s in records[0]["steps"][cfg["warmup"]:])
                print(f"  round {round_} {arm['name']}: median {statistics.median(times):.3f} s", flush=True)
    result.update(rows=summarize(cfg, result["records"]), load_after=loadavg(),
                  minutes=(time.monotonic() - started) / 60)
    write_results(args.out, "verl_step-quick" if q else "verl_step", result, markdown(result))
    return 0 if all(r["sp_batches_equal"] for r in result["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
