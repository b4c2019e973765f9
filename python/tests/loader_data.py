"""A small multimodal-ish dataset and collator for the LeaderLoader tests (module level, so that
DataLoader workers and every rank can import them)."""

import hashlib

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, Sampler, get_worker_info

from batches import SequenceContext


def xtuner_steps(loader, total_step, cur_epoch=1, cur_step=0):
    """XTuner's Trainer._data_iter: the trainer counts epochs from 1 and, when a pass ends, calls
    set_epoch(2), (3), ... and starts the next. Yields (step, epoch, batch) up to total_step."""
    data_iter = iter(loader)
    while cur_step < total_step:
        try:
            data = next(data_iter)
        except StopIteration:
            cur_epoch += 1
            loader.set_epoch(cur_epoch)
            data_iter = iter(loader)
            data = next(data_iter)
        cur_step += 1
        yield cur_step, cur_epoch, data


class Samples(Dataset):
    def __init__(self, n=16, length=64, noise=True, main_noise=False):
        self.n, self.length, self.noise, self.main_noise = n, length, noise, main_noise

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(1000 + i)
        ids = torch.randint(0, 5000, (self.length,), generator=g)
        # In a worker, augmentation draws from the worker's generator, which PyTorch seeds from
        # the loader's base seed: the batch depends on the base seed the leader drew. (A run
        # resumed in a new process draws other base seeds, so the restart test turns it off.)
        if get_worker_info() is not None:
            noise = torch.randint(0, 7, (1,)) if self.noise else torch.zeros(1, dtype=torch.int64)
        else:
            # Read in the main process (num_workers=0), augmentation draws from the default
            # generator itself, which followers must mirror: 1 or 2 words (odd totals too), and
            # for one sample more than a Mersenne Twister block.
            if self.main_noise:
                noise = torch.randint(0, 7, (1 + i % 2,)).sum(0, keepdim=True)
                if i == 5:
                    noise = noise + (torch.rand(1000) > 0.5).sum()
            else:
                noise = torch.zeros(1, dtype=torch.int64)
        pixels = torch.randn(4, 8, generator=g) + noise
        return ids, pixels


def collate(items):
    ids = torch.cat([x[0] for x in items]).unsqueeze(0)
    lens = [x[0].numel() for x in items]
    cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32)
    length = ids.shape[1]
    ctx = SequenceContext(
        input_ids=ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
        max_length_q=torch.tensor(max(lens)), max_length_k=torch.tensor(max(lens)),
        num_padding=0, position_ids=torch.arange(length).reshape(1, 1, length).expand(3, 1, length),
        pixel_values=torch.cat([x[1] for x in items]), num_img_tokens=[[4]] * len(items))
    labels = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], dim=1)
    return [{"seq_ctx": ctx, "shifted_labels": labels}]


class EpochSampler(Sampler):
    """A shuffle that depends only on (seed, epoch), like DistributedSampler's."""

    def __init__(self, n, seed=5):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.n

    def __iter__(self):
        g = torch.Generator().manual_seed(self.seed * 1000 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())


def digest(value):
    """A hash of everything the broadcast preserves that matters to these tests."""
    h = hashlib.sha256()

    def walk(v):
        if isinstance(v, torch.Tensor):
            h.update(f"T{v.dtype}{tuple(v.shape)}{v.stride()}".encode())
            h.update(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if v.numel() else b"")
        elif isinstance(v, (list, tuple)):
            h.update(f"L{len(v)}".encode())
            for x in v:
                walk(x)
        elif isinstance(v, dict):
            for k, x in v.items():
                h.update(f"K{k}".encode())
                walk(x)
        elif hasattr(v, "__dict__"):
            h.update(type(v).__qualname__.encode())
            walk(vars(v))
        else:
            h.update(repr(v).encode())

    walk(value)
    return h.hexdigest()


class StatefulLoader:
    """An iterable loader with its own state_dict (like torchdata's StatefulDataLoader)."""

    def __init__(self, n=6):
        self.n, self.epoch, self.start, self.pos, self.fetched = n, 0, 0, 0, 0

    def __len__(self):
        return self.n

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        start, self.start = self.start, 0
        for i in range(start, self.n):
            self.pos = i + 1
            self.fetched += 1
            yield {"epoch": self.epoch, "i": i, "t": torch.full((2,), self.epoch * 100 + i)}

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.start = state["pos"]


class XTunerLikeLoader:
    """XTuner's Dataloader as the trainer sees it: set_epoch (which draws from the default
    generator, as a sampler reseeding itself might), get_state_dict - a collective over the
    loader's DP group, as XTuner gathers consumed samples - and load_state_dict; iterating
    draws the base seed, as a DataLoader with workers does. A pass's order depends on
    (seed, epoch) only; each batch also carries the draw of the last set_epoch."""

    def __init__(self, seed, dp_group=None, n=10, batch=2):
        self.seed, self.dp_group, self.n, self.batch = seed, dp_group, n, batch
        self.epoch, self.pos, self.salt, self.consumed = 0, 0, -1, 0
        self.set_epochs = []  # every set_epoch call, for the tests

    def __len__(self):
        return self.n // self.batch

    def set_epoch(self, epoch):
        self.epoch = epoch
        self.salt = int(torch.randint(0, 1 << 30, (1,)))
        self.set_epochs.append(epoch)

    def __iter__(self):
        torch.empty((), dtype=torch.int64).random_()  # the base seed
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed * 1000 + self.epoch))
        start, self.pos = self.pos, 0
        for b in range(start, len(self)):
            self.pos = b + 1
            self.consumed += self.batch
            yield {"epoch": self.epoch, "salt": self.salt,
                   "idx": order[b * self.batch:(b + 1) * self.batch].clone()}
        self.pos = 0

    def get_state_dict(self, *extra):
        total = torch.tensor([self.consumed])
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return {"epoch": self.epoch, "salt": self.salt, "pos": self.pos,
                "total_consumed": int(total), "extra": list(extra)}

    def load_state_dict(self, state):
        self.epoch, self.salt, self.pos = state["epoch"], state["salt"], state["pos"]


class HookedLoader(XTunerLikeLoader):
    """State under other names: the LeaderLoader gets hooks for them."""

    get_state_dict = None
    load_state_dict = None

    def __init__(self, dataset, seed):
        super().__init__(seed, n=len(dataset))
        self.dataset = dataset

    def snapshot(self):
        return {"epoch": self.epoch, "salt": self.salt, "pos": self.pos}

    def restore(self, state):
        self.epoch, self.salt, self.pos = state["epoch"], state["salt"], state["pos"]
