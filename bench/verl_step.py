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

  ~/.cache/spbcast/venv-verl/bin/python bench/verl_step.py            # ~6 min here
  ~/.cache/spbcast/venv-verl/bin/python bench/verl_step.py --quick    # ~3 min
Prints the markdown table; writes it and the JSON of every rank's steps to --out
(bench/results/verl_step/; the JSON is git-ignored).
"""

import argparse
import hashlib
import os
import sys
import time

import torch.distributed as dist

from step_overhead import (add_trainer_options, loader_fields, trainer_config, trainer_markdown, trainer_run,
                           trainer_step)

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
            mine = int(hashlib.sha256(repr(vr.digest(data)).encode()).hexdigest()[:15], 16)
            end = trainer_step(record, cfg, i, mine, self.ulysses_device_mesh["sp"].get_group())
            last = clock["last"] if clock["last"] is not None else got
            record["steps"].append({"next": got - last, "step": end - last})
            clock["last"] = end
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
    record.update(loader_fields(stats))
    return record


def markdown(result):
    cfg = result["config"]
    return trainer_markdown(
        result, f"verl {result['verl']}",
        f"4 ranks, dp 2 x sp 2; batches of {cfg['batch_size']} multi-turn conversations per dp rank "
        f"({cfg['turns']} turns of {cfg['words']} words) that verl's MultiTurnSFTDataset tokenizes in "
        f"{cfg['workers']} DataLoader workers per rank, collated to jagged nested tensors",
        "followers: between steps, mean (ms)")


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
    parser.add_argument("--turns", type=int, default=8, help="turn pairs per conversation (default 8)")
    parser.add_argument("--words", type=int, default=12, help="words per turn (default 12)")
    add_trainer_options(parser, "verl_step")
    args = parser.parse_args()
    cfg = {"batch_size": 3, "turns": args.turns, "words": args.words, **trainer_config(args)}
    sys.path.insert(0, TESTS)
    import verl
    import verl_ranks as vr

    def write_data(folder, steps):
        vr.write_model(os.path.join(folder, "model"))
        write_dataset(os.path.join(folder, "data"), cfg["batch_size"] * (WORLD // SP) * steps, cfg["turns"],
                      cfg["words"])

    return trainer_run("verl_step", "verl", verl.__version__, args, cfg, write_data, run_arm, ARMS, SP, markdown)


if __name__ == "__main__":
    sys.exit(main())
