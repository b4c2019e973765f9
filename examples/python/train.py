"""A plain PyTorch trainer on spbcast.LeaderLoader, end to end (docs/python.md opens with it).

    torchrun --standalone --nproc-per-node 4 examples/python/train.py --sp 2              # dedup
    torchrun --standalone --nproc-per-node 4 examples/python/train.py --sp 2 --no-dedup   # BASE
    ... --save-at 5 --ckpt-dir ckpt     # writes a checkpoint after step 5 and goes on to the end
    ... --resume --ckpt-dir ckpt        # new processes continue from that checkpoint

DP x SP on Gloo. In each SP group only the leader (SP rank 0) runs a DataLoader, over its DP
replica's shard; spbcast.LeaderLoader hands every batch to the other ranks of the group. Each
rank prints a digest of the batches it saw, of its final parameters and of its default CPU
generator: the same with --no-dedup (every rank loads: BASE), and after a resume the same as
without one (python/tests/test_example.py checks both).
"""

import argparse
import dataclasses
import datetime
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, Subset

import spbcast


@dataclasses.dataclass
class Meta:
    index: int
    source: str


# Every rank, at import time: a follower rebuilds only the classes its own program allows.
spbcast.allow_classes(Meta)


class Images(Dataset):
    """A map-style dataset of dict samples: a 3 KiB image, a label and a dataclass. Sample `bad`
    raises ValueError, as a dataset meeting an image it cannot decode."""

    def __init__(self, n=64, bad=None):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i}: cannot decode the image")
        g = torch.Generator().manual_seed(i)  # a sample is a function of its index alone
        return {"pixel_values": torch.randn(3, 16, 16, generator=g), "label": i % 4,
                "meta": Meta(i, f"shard-{i % 8}.tar")}


def collate(samples):
    return {"pixel_values": torch.stack([s["pixel_values"] for s in samples]),
            "labels": torch.tensor([s["label"] for s in samples]),
            "meta": [s["meta"] for s in samples]}


def sha(*parts):
    h = hashlib.sha256()
    for p in parts:
        h.update(p.numpy().tobytes() if isinstance(p, torch.Tensor) else repr(p).encode())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=2, help="SP size (divides the world size)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--dedup", action=argparse.BooleanOptionalAction, default=True,
                   help="--no-dedup: every rank runs its own DataLoader (BASE)")
    p.add_argument("--save-at", type=int, help="write a checkpoint after this step, and go on")
    p.add_argument("--resume", action="store_true", help="continue from --ckpt-dir's checkpoint")
    p.add_argument("--ckpt-dir", default="ckpt")
    p.add_argument("--record", help="a JSON file for every rank's per-step batch digests")
    p.add_argument("--bad-index", type=int, help="a sample the dataset raises ValueError for")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=2))
    rank, world = dist.get_rank(), dist.get_world_size()
    sp, dp = args.sp, world // args.sp
    assert sp * dp == world, "--sp must divide the world size"
    # SP groups of consecutive ranks ([0, 1], [2, 3]), DP groups across them ([0, 2], [1, 3]).
    # new_group is a collective of the whole world: every rank creates every group, in the same
    # order, and keeps its own. (With a mesh: init_device_mesh("cpu", (dp, sp),
    # mesh_dim_names=("dp", "sp")), then mesh["sp"].get_group() and mesh["dp"].get_group().)
    for ranks in [list(range(d * sp, d * sp + sp)) for d in range(dp)]:
        group = dist.new_group(ranks)
        if rank in ranks:
            sp_group, sp_ranks = group, ranks
    for ranks in [list(range(s, world, sp)) for s in range(sp)]:
        group = dist.new_group(ranks)
        if rank in ranks:
            dp_group, dp_ranks = group, ranks
    dp_rank = rank // sp

    torch.manual_seed(0)  # the same initial model on every rank
    model = nn.Sequential(nn.Flatten(), nn.Linear(768, 64), nn.ReLU(), nn.Dropout(0.2),
                          nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # One seed per SP group: its ranks must draw alike (the same dropout masks on the same batch;
    # in BASE, the same shuffle). With dedup the followers' generators follow the leader's draws.
    torch.manual_seed(1 + dp_rank)

    def make_loader():  # dedup: called on the SP leader only; BASE: on every rank
        shard = Subset(Images(bad=args.bad_index), range(dp_rank, 64, dp))  # this DP replica's
        return DataLoader(shard, batch_size=4, shuffle=True, collate_fn=collate, num_workers=2,
                          multiprocessing_context="fork")  # shuffle: a RandomSampler

    ckpt_path = os.path.join(args.ckpt_dir, f"ckpt-rank{rank}.pt")
    steps, skipped, seen, step = {}, [], hashlib.sha256(), 0
    with spbcast.LeaderLoader(make_loader, sp_group, sp_media_dedup=args.dedup,
                              total_epoch=args.epochs) as loader:
        built = loader.loader is not None  # with dedup, on the SP leader only
        if args.resume:
            ckpt = torch.load(ckpt_path)
            model.load_state_dict(ckpt["model"])
            opt.load_state_dict(ckpt["optimizer"])
            step = ckpt["step"]
            # The trainer's generator (dropout; the next epoch's shuffle is drawn from it), before
            # the loader's state: whatever restoring the loader draws then comes after it.
            torch.set_rng_state(ckpt["rng"])
            # Every SP rank (a collective over the SP group): the leader restores its position
            # from its own state; a follower's is {} and ignored.
            loader.load_state_dict(ckpt["loader"])
        it = iter(loader)
        while True:
            batch, error = None, None
            try:
                batch = next(it)
            except StopIteration:
                break
            except ValueError as e:
                # The dataset's own error. With dedup every rank of the SP group gets it as
                # spbcast.LoaderError (code "loader"), which is also a ValueError; in BASE each
                # rank's DataLoader raises the ValueError itself. Any other spbcast.Error (a batch
                # spbcast refused: a class not allowed, a CUDA tensor) is not caught: a program
                # error to fix, not a sample to skip.
                error = ("spbcast.LoaderError" if isinstance(e, spbcast.LoaderError)
                         else "ValueError")
                sys.stdout.write(f"rank {rank}: step {step + 1}: {error}, skipped\n")
            # The trainer's own count, one a next(): loader.step counts no failed fetch, so it
            # would differ between the DP replica that failed and the other.
            step += 1
            steps[step] = error or sha(batch["pixel_values"], batch["labels"], batch["meta"])
            # Skip only if every DP replica skips: a replica that trained on would wait for this
            # one in the gradient all-reduce below (in BASE as with dedup).
            failed = torch.tensor([int(error is not None)])
            dist.all_reduce(failed, op=dist.ReduceOp.MAX, group=dp_group)
            if failed.item():
                skipped.append(step)
                continue
            seen.update(steps[step].encode())

            # (A real SP model splits each sequence over the SP group; this one is about the data,
            # so every SP rank runs the whole batch.)
            loss = nn.functional.cross_entropy(model(batch["pixel_values"]), batch["labels"])
            opt.zero_grad()
            loss.backward()
            for param in model.parameters():  # the DP average keeps the replicas equal
                dist.all_reduce(param.grad, group=dp_group)
                param.grad /= dp
            opt.step()

            if step == args.save_at:
                os.makedirs(args.ckpt_dir, exist_ok=True)
                torch.save({"step": step, "model": model.state_dict(),
                            "optimizer": opt.state_dict(),
                            "loader": loader.state_dict(),  # every rank; {} on dedup followers
                            "rng": torch.get_rng_state()}, ckpt_path)

    params = sha(*[t.detach() for t in model.state_dict().values()])
    rng = sha(torch.get_rng_state())
    # One write per line: the ranks share torchrun's stdout.
    sys.stdout.write(f"rank {rank} (SP group {sp_ranks}, DP group {dp_ranks}) batches "
                     f"{seen.hexdigest()[:16]} params {params} rng {rng}\n")
    sys.stdout.flush()
    if args.record:
        mine = {"sp_group": sp_ranks, "dp_group": dp_ranks, "leader": loader.is_leader,
                "built": built, "steps": steps, "skipped": skipped, "params": params, "rng": rng}
        everyone = [None] * world if rank == 0 else None
        dist.gather_object(mine, everyone, dst=0)
        if rank == 0:
            with open(args.record, "w") as f:
                json.dump(everyone, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
