"""SP leader-only loading from Python: DP x SP groups, one DataLoader per SP group.

    torchrun --standalone --nproc-per-node 4 examples/python/sp_train.py --sp 2
    torchrun --standalone --nproc-per-node 4 examples/python/sp_train.py --sp 2 --no-dedup   # BASE

Each SP group's leader runs a torch.utils.data.DataLoader; spbcast.LeaderLoader broadcasts each
collated batch - an XTuner-shaped list of {seq_ctx, shifted_labels}, seq_ctx a dataclass - to
the other ranks of its SP group. Every rank prints a digest of the batches it saw and of its
default CPU generator at the end: equal within an SP group, and equal with and without dedup.
"""

import argparse
import dataclasses
import datetime
import hashlib
import os
import sys
from typing import List, Optional

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import spbcast


@dataclasses.dataclass
class SequenceContext:
    input_ids: torch.Tensor
    cu_seq_lens_q: torch.Tensor
    cu_seq_lens_k: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: Optional[torch.Tensor]
    num_img_tokens: List[List[int]]
    num_padding: int = 0


spbcast.allow_classes(SequenceContext)  # on every rank: followers rebuild only allowed classes


class Samples(Dataset):
    """Stands in for a multimodal dataset: tokens and image patches per sample."""

    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        n = int(torch.randint(64, 256, (1,), generator=g))
        return torch.randint(0, 150000, (n,), generator=g), torch.randn(n // 4, 1536, generator=g)


def collate(items):
    ids = torch.cat([x[0] for x in items]).unsqueeze(0)
    lens = torch.tensor([x[0].numel() for x in items])
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lens.cumsum(0).to(torch.int32)])
    length = ids.shape[1]
    ctx = SequenceContext(
        input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,  # one tensor, referenced twice
        position_ids=torch.arange(length).reshape(1, 1, length).expand(3, 1, length),
        pixel_values=torch.cat([x[1] for x in items]),
        num_img_tokens=[[x[1].shape[0]] for x in items])
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    return [{"seq_ctx": ctx, "shifted_labels": labels}]


def digest(batch, h):
    for item in batch:
        ctx = item["seq_ctx"]
        for t in (ctx.input_ids, ctx.cu_seq_lens_q, ctx.pixel_values, item["shifted_labels"]):
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sp", type=int, default=2, help="SP size (divides the world size)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--no-dedup", action="store_true", help="every rank loads (BASE)")
    args = p.parse_args()

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    assert world % args.sp == 0, "--sp must divide the world size"
    # Every rank creates every SP group (new_group is collective); each keeps its own.
    groups = [dist.new_group(list(range(s, s + args.sp))) for s in range(0, world, args.sp)]
    sp_group = groups[rank // args.sp]
    dp_rank, dp_size = rank // args.sp, world // args.sp
    torch.manual_seed(dp_rank)  # the same seed within an SP group, as SP ranks need one batch

    def make_loader():
        sampler = DistributedSampler(Samples(), num_replicas=dp_size, rank=dp_rank, seed=0)
        return DataLoader(Samples(), batch_size=4, sampler=sampler, collate_fn=collate,
                          num_workers=2)

    loader = spbcast.LeaderLoader(make_loader, sp_group, sp_media_dedup=not args.no_dedup,
                                  total_epoch=args.epochs)
    h = hashlib.sha256()
    for batch in loader:
        ctx = batch[0]["seq_ctx"]
        assert ctx.cu_seq_lens_k is ctx.cu_seq_lens_q and ctx.position_ids.stride(0) == 0
        digest(batch, h)
        torch.rand(8)  # the model step's own random draws (dropout, ...)
    h.update(torch.get_rng_state().numpy().tobytes())
    # One write per line: the ranks share torchrun's stdout, and an unbuffered print() writes
    # the line and its end separately, so another rank's line could land in between.
    sys.stdout.write(f"rank {rank} (SP group {dp_rank}, SP rank {dist.get_rank(sp_group)}): "
                     f"{loader.step} steps, {loader.epoch} epochs, loader built here: "
                     f"{loader.loader is not None}, digest {h.hexdigest()[:16]}\n")
    sys.stdout.flush()

    # spbcast.broadcast on its own: a tree of supported values, from any global rank.
    info = spbcast.broadcast({"from": rank, "note": b"\x00bytes"} if rank == world - 1 else None,
                             src=world - 1)
    assert info["from"] == world - 1
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
