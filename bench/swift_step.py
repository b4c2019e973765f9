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
import os
import sys
import time

import torch
import torch.distributed as dist

from step_overhead import (MiB, add_trainer_options, checksum, loader_fields, trainer_config, trainer_markdown,
                           trainer_run, trainer_step)

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "python", "tests")
WORLD, SP = 4, 2
ARMS = ({"name": "base", "dedup": False}, {"name": "dedup", "dedup": True})


def run_arm(arm, cfg, data, rank):
    import spbcast.swift
    import swift_ranks as sr
    from swift.pipelines.train.sft import SwiftSft
    from swift.sequence_parallel import sequence_parallel

    sr.IMAGE_MAX_PIXELS["value"] = cfg["image"] * cfg["image"]

    total = cfg["warmup"] + cfg["steps"]
    record = {"arm": arm["name"], "rank": rank, "steps": [], "mismatches": 0}

    def loop(trainer):
        loader = trainer.get_train_dataloader()
        sp_group = sequence_parallel.sp_group
        dist.barrier()
        last = asked = time.monotonic()
        for i, batch in enumerate(loader):
            got = time.monotonic()
            end = trainer_step(record, cfg, i, checksum(batch), sp_group)
            record["steps"].append({"next": got - asked, "step": end - last,
                                    "mib": sum(t.numel() * t.element_size() for t in batch.values()
                                               if isinstance(t, torch.Tensor)) / MiB})
            if i + 1 == total:
                break
            last = asked = end
        stats = spbcast.swift.stats(loader)
        record.update(loader_fields(stats))

    if arm["dedup"]:
        spbcast.swift.enable()
    pipeline = SwiftSft(sr.sft_arguments(sr.Arm(arm["name"], arm["dedup"], workers=cfg["workers"],
                                                batch_size=cfg["batch_size"], max_steps=total,
                                                save_steps=10 * total), data))
    pipeline.train = loop
    pipeline.main()
    return record


def markdown(result):
    cfg = result["config"]
    return trainer_markdown(
        result, f"ms-swift {result['swift']}",
        f"4 ranks, SP2 x DP2; batches of {cfg['batch_size']} samples, each a {cfg['image']} x {cfg['image']} "
        f"PNG image and text that ms-swift's Qwen2-VL template encodes in {cfg['workers']} DataLoader workers "
        "per rank", "followers: next() mean (ms)", batch_column=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="224 px images, 0.2 s steps, 1 round of 4 steps")
    parser.add_argument("--image", type=int, help="image side in pixels, a multiple of 28 (default 448; quick 224)")
    parser.add_argument("--batch-size", type=int, default=4, help="samples per batch (default 4)")
    add_trainer_options(parser, "swift_step")
    args = parser.parse_args()
    q = args.quick
    cfg = {"image": args.image or (224 if q else 448), "batch_size": args.batch_size, **trainer_config(args)}
    if cfg["image"] % 28:
        parser.error("--image must be a multiple of 28 (Qwen2-VL's patch 14 x merge 2)")
    sys.path.insert(0, TESTS)
    import swift
    import swift_ranks as sr

    def write_data(folder, steps):
        sr.write_model(os.path.join(folder, "model"))
        sr.write_dataset(os.path.join(folder, "data"), n=cfg["batch_size"] * (WORLD // SP) * steps, side=cfg["image"])

    return trainer_run("swift_step", "swift", swift.__version__, args, cfg, write_data, run_arm, ARMS, SP, markdown,
                       lambda mine: {"batch_mib": mine[0]["steps"][0]["mib"]})


if __name__ == "__main__":
    sys.exit(main())
