"""spbcast against XTuner v1 itself: its text pipeline (JsonlDataset, ExpandSoftPackDataset /
HardPackDataset, LengthGroupedSampler / ParallelSampler, its Dataloader as DataloaderConfig.build
makes it, with 0 and 2 forked persistent workers) and a Qwen3-VL one (qwen3_vl_sft_collator,
pixel_values, image_grid_thw, 3-D rope position_ids), over DP 2 x SP 2 real Gloo groups built
as XTuner's Trainer builds its data mesh, driven as its Trainer drives the loader (epochs counted
from 1, set_epoch(2), (3), ... after each pass; the state saved by rank 0 with get_state_dict and
loaded on every rank). BASE (every rank loads, XTuner unchanged) against dedup (the Trainer's
dataloader wrapped in spbcast.LeaderLoader, docs/xtuner.md): every step's
batch bit for bit with XTuner's own classes, tensor identity, views and storage offsets, and
torch.get_rng_state() after every step; resumed mid-epoch and at an epoch's end through XTuner's
own state in a new run, against the continuous run.

Skipped, saying why, where XTuner v1 is not importable (scripts/setup.sh installs it from
../shared/wheels or $SPBCAST_XTUNER_WHEEL). XTuner's imports take seconds per process, so each
test runs its cases in one set of four ranks."""

import copy
import gc
import json
import os

import torch
import torch.distributed as dist

from batches import assert_same, assert_same_aliasing
from dist_harness import run
from loader_data import xtuner_steps
from xtuner_available import skip_without_xtuner


pytestmark = skip_without_xtuner()

SEED = 7


def xtuner_loop(loader, total_step, ckpt_dir, rank, cur_epoch=1, cur_step=0, save_at=()):
    """XTuner's Trainer.fit around Trainer._data_iter: epochs from 1, set_epoch(2), (3), ... after
    each pass; a model step that draws from the default generator; at each step in save_at the
    checkpoint as Trainer._save_dataloader writes it (get_state_dict on every rank, saved by rank
    0) with the train state (cur_step, cur_epoch). Returns [(batch, epoch, rng after the step)]."""
    seen = []
    for step, epoch, data in xtuner_steps(loader, total_step, cur_epoch, cur_step):
        torch.rand(4)  # the model step's own draws
        seen.append((data, epoch, torch.get_rng_state()))
        if step in save_at:
            state = loader.get_state_dict()
            if rank == 0:
                torch.save(state, os.path.join(ckpt_dir, f"dataloader-{step}"))
                with open(os.path.join(ckpt_dir, f"train_state-{step}.json"), "w") as f:
                    json.dump({"cur_step": step, "cur_epoch": epoch}, f)
    return seen


def resume(make, total_step, ckpt_dir, rank, step):
    """A new run resumed as Trainer._load_checkpoint does: the seed set at start, the dataloader
    built, then rank 0's dataloader state loaded on every rank and the train state restored."""
    import xtuner_pipeline as xp

    xp.set_random_seed(SEED)
    loader = make()
    with open(os.path.join(ckpt_dir, f"train_state-{step}.json")) as f:
        train_state = json.load(f)
    loader.load_state_dict(torch.load(os.path.join(ckpt_dir, f"dataloader-{step}"), map_location="cpu"))
    return xtuner_loop(loader, total_step, ckpt_dir, rank, train_state["cur_epoch"], train_state["cur_step"])


def same_batch(expected, got, path):
    """Bit for bit, the same classes, tensor identity and storage sharing, and each tensor's
    storage offset."""
    pairs = []
    assert_same(expected, got, path, pairs)
    assert_same_aliasing(pairs)
    for e, g, p in pairs:
        assert g.storage_offset() == e.storage_offset(), f"{p}: storage offset {g.storage_offset()} != {e.storage_offset()}"


def without_noise(steps):
    """The steps with each SequenceContext's pixel_values (the augmentation, drawn from the
    default generator) left out, the rest as it is (the same tensor objects): a resumed run's
    generator is not the continuous run's (XTuner does not checkpoint it), so only the data
    order and everything else can equal the continuous run's."""
    out = []
    for batch, epoch, rng in steps:
        stripped = []
        for item in batch:
            ctx = copy.copy(item["seq_ctx"])
            ctx.pixel_values = None
            stripped.append(dict(item, seq_ctx=ctx))
        out.append((stripped, epoch, rng))
    return out


def same_steps(base, got, what, rng=True, first_step=1, noise=False):
    """Step by step: the same epoch and batch, and with rng the same default generator after
    the step; with noise, without the pixel augmentation (see without_noise)."""
    assert len(got) == len(base), f"{what}: {len(got)} steps, BASE {len(base)}"
    if noise:
        base, got = without_noise(base), without_noise(got)
    for i, ((bb, be, br), (gb, ge, gr)) in enumerate(zip(base, got)):
        step = first_step + i
        assert ge == be, f"{what}: step {step}: epoch {ge} != BASE {be}"
        same_batch(bb, gb, f"{what}: step {step}: batch")
        if rng:
            assert torch.equal(br, gr), f"{what}: step {step}: default generator differs from BASE"


def _pipeline(rank, world, kind, data_dir, cases):
    # What torchrun sets, which XTuner reads to find each host's first rank (the one that writes
    # the shared files of its dataset and packing caches while the others wait in a barrier).
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import xtuner_pipeline as xp

    xp.use_cache_dir(os.path.join(data_dir, "xtuner_mmap"))
    from torch.distributed.device_mesh import init_device_mesh

    import spbcast

    # XTuner's Trainer._init_data_mesh: (dp, sp, tp) over the world; SP groups [0, 1] and [2, 3].
    mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "sp", "tp"))
    sp_group, dp_mesh = mesh["sp"].get_group(), mesh["dp"]
    assert dist.get_process_group_ranks(sp_group) == [rank // 2 * 2, rank // 2 * 2 + 1]
    tokenizer = xp.make_tokenizer()
    if rank == 0:
        xp.write_text_data(data_dir, n=24) if kind == "text" else xp.write_vl_data(data_dir, n=40)
    dist.barrier()
    path = os.path.join(data_dir, "text.jsonl" if kind == "text" else "vl.jsonl")

    for case in cases:
        workers = case["workers"]
        cfg = (xp.text_config(path, num_workers=workers, **case.get("config", {})) if kind == "text"
               else xp.vl_config(path, num_workers=workers))
        noise = kind == "vl"  # its pixels get an augmentation from the default generator
        ckpt = os.path.join(data_dir, f"ckpt-{case['name']}")
        os.makedirs(ckpt, exist_ok=True)

        def build():
            # XTuner's Trainer.__init__: DataloaderConfig.build on every rank (its dataset
            # construction is collective: new_group, all_gather_object, barriers).
            return cfg.build(tokenizer=tokenizer, dp_mesh=dp_mesh, global_batch_size=2,
                             micro_batch_size=1, seed=SEED)

        def dedup():
            # The one line a Trainer changes: only the SP leader iterates the dataloader.
            dataloader = build()
            return spbcast.LeaderLoader(lambda: dataloader, sp_group, sp_media_dedup=True,
                                        first_epoch=1, set_epoch=None)

        xp.set_random_seed(SEED)
        loader = build()
        assert isinstance(loader, xp.XTunerDataloader) and type(loader.sampler).__name__ == case["sampler"]
        steps = len(loader)
        total, mid, end = 3 * steps, steps + steps // 2, 2 * steps  # mid-epoch 2, end of epoch 2
        base = xtuner_loop(loader, total, ckpt, rank, save_at=(mid, end))
        del loader
        assert [e for _, e, _ in base] == [1] * steps + [2] * steps + [3] * steps
        ctx = base[0][0][0]["seq_ctx"]
        assert type(ctx) is xp.SequenceContext and ctx.cu_seq_lens_q is ctx.cu_seq_lens_k
        if case.get("views"):  # unpadded packs: input_ids and shifted_labels stay views
            assert any(b[0]["shifted_labels"].storage_offset() == 1 for b, _, _ in base), case["name"]
        if kind == "vl":
            assert ctx.pixel_values.shape[1] == 1536 and ctx.position_ids.shape[0] == 3
        # Within an SP group BASE ranks load the same batches; the DP replicas different ones.
        digests = [None] * world
        dist.all_gather_object(digests, [b[0]["seq_ctx"].input_ids.tolist() for b, _, _ in base])
        assert digests[0] == digests[1] and digests[2] == digests[3] and digests[0] != digests[2]

        xp.set_random_seed(SEED)
        ll = dedup()
        assert len(ll) == steps and (ll.loader is not None) == (rank % 2 == 0)
        os.makedirs(ckpt + "-dedup", exist_ok=True)
        got = xtuner_loop(ll, total, ckpt + "-dedup", rank, save_at=(mid, end))
        same_steps(base, got, f"{case['name']}: dedup")
        if not ll.is_leader:
            assert ll.loader is None
        del ll
        gc.collect()
        dist.barrier()  # rank 0's checkpoints are written

        for step in (mid, end):
            resumed_base = resume(build, total, ckpt, rank, step)
            if step == mid:  # XTuner's own resume mid-epoch: the continuous run's batches
                same_steps(base[step:], resumed_base, f"{case['name']}: resumed BASE", rng=False,
                           first_step=step + 1, noise=noise)
            else:
                # XTuner's own state at an epoch's last step keeps that epoch with its sampler
                # step wrapped to 0: its resume (BASE) runs that epoch again. The drop-in does
                # as BASE; LeaderLoader driving the epochs resumes into the next (below).
                same_steps(base[step - steps:step], resumed_base[:steps],
                           f"{case['name']}: resumed BASE repeating epoch 2", rng=False,
                           first_step=step + 1, noise=noise)
            resumed = resume(dedup, total, ckpt + "-dedup", rank, step)
            same_steps(resumed_base, resumed, f"{case['name']}: resumed dedup at step {step}",
                       first_step=step + 1)
            gc.collect()

        if case.get("driven"):
            # LeaderLoader driving the passes in XTuner's numbering (first_epoch=1: set_epoch(2),
            # (3) with no trainer call), BASE (dedup off) and dedup, resumed at the epoch's end.
            def driven(dedup_on):
                dataloader = build()
                return spbcast.LeaderLoader(lambda: dataloader, sp_group, sp_media_dedup=dedup_on,
                                            first_epoch=1, total_step=total)

            runs = {}
            for dedup_on in (False, True):
                xp.set_random_seed(SEED)
                ll = driven(dedup_on)
                seen, state = [], None
                for data in ll:
                    torch.rand(4)
                    seen.append((data, ll.epoch, torch.get_rng_state()))
                    if ll.step == end:
                        state = ll.get_state_dict()
                states = [None] * world
                dist.all_gather_object(states, state)
                runs[dedup_on] = seen
                same_steps(base, seen, f"{case['name']}: LeaderLoader driving (dedup {dedup_on})",
                           rng=dedup_on)
                xp.set_random_seed(SEED)
                ll = driven(dedup_on)
                ll.load_state_dict(states[0])  # rank 0's, on every rank
                resumed = []
                for data in ll:
                    torch.rand(4)
                    resumed.append((data, ll.epoch, torch.get_rng_state()))
                runs[("resumed", dedup_on)] = resumed
                same_steps(base[end:], resumed, f"{case['name']}: LeaderLoader driving, resumed at "
                           f"the end of epoch 2 (dedup {dedup_on})", rng=False, first_step=end + 1,
                           noise=noise)
                del ll
                gc.collect()
            same_steps(runs[False], runs[True], f"{case['name']}: LeaderLoader driving, dedup vs BASE")
            same_steps(runs[("resumed", False)], runs[("resumed", True)],
                       f"{case['name']}: LeaderLoader driving, resumed dedup vs BASE", first_step=end + 1)
        dist.barrier()


def test_xtuner_text_pipeline(tmp_path):
    cases = [
        {"name": "soft-w0", "workers": 0, "sampler": "LengthGroupedSampler", "driven": True},
        {"name": "soft-w2", "workers": 2, "sampler": "LengthGroupedSampler"},
        {"name": "hard-w2", "workers": 2, "sampler": "ParallelSampler", "views": True,
         "config": {"pack_level": "hard", "group_by_length": False, "pack_to_max_length": False}},
    ]
    run(4, _pipeline, "text", str(tmp_path), cases, timeout=240)


def test_xtuner_qwen3_vl_pipeline(tmp_path):
    cases = [{"name": "vl-w0", "workers": 0, "sampler": "LengthGroupedSampler"},
             {"name": "vl-w2", "workers": 2, "sampler": "LengthGroupedSampler", "driven": True}]
    run(4, _pipeline, "vl", str(tmp_path), cases, timeout=240)
