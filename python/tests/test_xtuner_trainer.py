"""spbcast's XTuner switch proven by training: XTuner v1's own ``Trainer.fit()``, unmodified, at
DP 2 x SP 2 over Gloo on CPU, with ``spbcast.xtuner.DataloaderConfig`` off (BASE: every rank
loads, XTuner as shipped) and on (dedup), XTuner's text pipeline with 0 and 2 persistent loader
workers, two epochs (the step count from XTuner's total_epoch).

Per step and per rank, bit for bit: the model input after the SP split, the loss, the grad norm,
``torch.get_rng_state()`` after the fetch and after the optimizer step; then the final parameter
shards. Only the SP leaders create a DataLoader iterator under dedup. Resumed in new processes
through XTuner's own checkpoints (mid-epoch, right after an epoch's last step, and across the
switch both ways, and from the LeaderLoader state that dedup wired by hand saved before the
switch existed): a resumed run equals BASE resumed the same way (XTuner saves no generator
state, so generators are compared between resumed runs), and its batches mid-epoch equal the
continuous run's. A negative control - one extra draw on each follower - must fail the
comparison.

Skipped, saying why, where XTuner v1 is not importable (scripts/setup.sh installs it). The ranks
are forked from this process, which imports XTuner once (xtuner_trainer.py)."""

import pickle
import re

import pytest

from batches import assert_same
from xtuner_available import skip_without_xtuner

pytestmark = skip_without_xtuner()

MID, END = 2, 4  # checkpoints: mid-epoch, and right after the first epoch's last step
LEADERS, FOLLOWERS = (0, 2), (1, 3)  # XTuner's (dp, sp, tp) mesh at DP 2 x SP 2


def same_steps(expected, got, what, keys=("model_input", "loss", "grad_norm", "rng_after_fetch",
                                          "rng_after_step", "cur_step", "epoch")):
    assert len(got) == len(expected), f"{what}: {len(got)} steps, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        for key in keys:
            assert_same(e[key], g[key], f"{what}: step {e['cur_step'] + 1} {key}")


def same_run(expected, got, what):
    """Two arms, rank by rank: every step, the final parameters, the loop's length."""
    for rank, (e, g) in enumerate(zip(expected, got)):
        where = f"{what}, rank {rank}"
        assert g["total_step"] == e["total_step"], f"{where}: total_step"
        assert g["loader_len"] == e["loader_len"], f"{where}: len(dataloader)"
        same_steps(e["steps"], g["steps"], where)
        assert_same(e["params"], g["params"], f"{where}: final parameters")


def only_leaders_iterate(run, what):
    for rank in LEADERS:
        assert run[rank]["iterators"] > 0, f"{what}: SP leader {rank} never iterated its DataLoader"
    for rank in FOLLOWERS:
        assert run[rank]["iterators"] == 0, (
            f"{what}: SP follower {rank} created {run[rank]['iterators']} DataLoader iterators")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import xtuner_trainer as xt

    root = str(tmp_path_factory.mktemp("xtuner-fit"))
    tokenizer_dir, data = xt.write_inputs(root)
    Arm = xt.Arm
    continuous = [Arm("base0", False), Arm("dedup0", True), Arm("base2", False, workers=2),
                  Arm("dedup2", True, workers=2), Arm("extra_draw", True, extra_draw=MID),
                  Arm("hand_wired0", True, hand_wired=True)]
    resumed = [Arm(f"{name}@{step}", name.startswith("dedup"), workers=int(name[-1]),
                   resume=(name, step))
               for name, step in (("base0", MID), ("dedup0", MID), ("base0", END), ("dedup0", END),
                                  ("base2", MID), ("dedup2", MID))]
    # Across the switch: dedup resumed from BASE's checkpoint, BASE from dedup's.
    resumed += [Arm("dedup0@base0", True, resume=("base0", MID)),
                Arm("base0@dedup0", False, resume=("dedup0", MID)),
                Arm("dedup0@base0-end", True, resume=("base0", END)),
                Arm("dedup0@hand_wired0", True, resume=("hand_wired0", MID))]
    records = xt.launch(root, continuous, tokenizer_dir, data)
    records.update(xt.launch(root, resumed, tokenizer_dir, data))  # new processes
    records["inputs"] = (root, tokenizer_dir, data)
    return records


def test_dedup_trains_like_base(runs):
    for workers in (0, 2):
        base, dedup = runs[f"base{workers}"], runs[f"dedup{workers}"]
        assert base[0]["total_step"] == 2 * base[0]["loader_len"] > 2, "two epochs of several steps"
        same_run(base, dedup, f"{workers} workers: BASE against dedup")
        only_leaders_iterate(dedup, f"dedup, {workers} workers")
        # On by default under the switch: every step's batch but a pass's first was prefetched.
        assert [r["prefetch"] for r in dedup] == [1] * len(dedup), [r["prefetch"] for r in dedup]
        assert all(r["iterators"] > 0 for r in base), "BASE: every rank iterates"
    same_run(runs["base0"], runs["hand_wired0"], "BASE against dedup wired by hand")


def test_negative_control_fails(runs):
    with pytest.raises(AssertionError, match="rng_after_fetch"):
        same_run(runs["base0"], runs["extra_draw"], "BASE against dedup with an extra draw")


@pytest.mark.parametrize("arm,base,continuous,step", [
    ("dedup0@2", "base0@2", "base0", MID), ("dedup0@4", "base0@4", None, END),
    ("dedup2@2", "base2@2", "base2", MID),
    ("dedup0@base0", "base0@2", "base0", MID), ("base0@dedup0", "base0@2", "base0", MID),
    ("dedup0@base0-end", "base0@4", None, END),
    ("dedup0@hand_wired0", "base0@2", "base0", MID)])
def test_resumed(runs, arm, base, continuous, step):
    """A resumed arm against BASE resumed the same way (generators included), and mid-epoch its
    batches against the continuous run's. XTuner's own state right after an epoch's last step
    runs that epoch again (the sampler's step wraps to 0); BASE and dedup alike."""
    same_run(runs[base], runs[arm], f"{arm} against {base}")
    resumed = runs[arm]
    assert resumed[0]["steps"][0]["cur_step"] == step
    if arm.startswith("dedup"):
        only_leaders_iterate(resumed, arm)
    if continuous is not None:
        for rank in range(len(resumed)):
            same_steps(runs[continuous][rank]["steps"][step:], resumed[rank]["steps"],
                       f"{arm} against the continuous {continuous}, rank {rank}",
                       keys=("model_input", "cur_step", "epoch"))


def _build_trainer_from(inputs, arm):
    """The exception Trainer(...) raised (its class names and message), or None."""
    import xtuner_trainer as xt

    try:
        xt.make_trainer(arm, *inputs)
    except Exception as e:  # noqa: BLE001 - what the user's script would see
        return [c.__name__ for c in type(e).__mro__], str(e)
    return None


def test_checkpoint_that_does_not_fit_fails_in_trainer(runs):
    """A checkpoint the data config cannot load (pack_max_length changed): XTuner's own ValueError
    inside Trainer(...) on every rank, with the switch as in BASE - not at fit()'s first fetch."""
    import xtuner_trainer as xt

    root = runs["inputs"][0]
    outcome = {}
    for dedup in (False, True):
        arm = xt.Arm(f"misfit-{dedup}", dedup, resume=("base0", MID), pack_max_length=48)
        outcome[dedup] = xt.fork_ranks(root, arm.name, lambda rank: _build_trainer_from(runs["inputs"], arm))
    for rank in range(len(outcome[False])):
        base, dedup = outcome[False][rank], outcome[True][rank]
        assert base is not None and base[0][0] == "ValueError", f"BASE, rank {rank}: {base}"
        assert "different pack_max_length" in base[1], base[1]
        assert dedup is not None, f"dedup, rank {rank}: Trainer(...) accepted the checkpoint"
        assert "ValueError" in dedup[0] and "LoaderError" in dedup[0], f"dedup, rank {rank}: {dedup[0]}"
        assert base[1] in dedup[1], f"dedup, rank {rank}: {dedup[1]!r} lacks XTuner's {base[1]!r}"


def test_config_pickles():
    """XTuner pickles the trainer config, with its dataloader config, into every checkpoint."""
    import xtuner_trainer as xt

    import spbcast.xtuner

    config = xt.xp.text_config("data.jsonl", num_workers=2, sp_media_dedup=True,
                               config_class=spbcast.xtuner.DataloaderConfig)
    loaded = pickle.loads(pickle.dumps(config))
    assert type(loaded) is spbcast.xtuner.DataloaderConfig and loaded.sp_media_dedup
    assert loaded.model_dump() == config.model_dump()


def _switch_checks(data):
    """Every rank builds XTuner's dataloader through the switch on several data meshes: what each
    build returned, or the spbcast.Error it raised (the same on every rank, before any
    collective: a rank that waited in one would hang the job)."""
    import xtuner_trainer as xt
    from torch.distributed.device_mesh import init_device_mesh

    import spbcast
    import spbcast.xtuner

    tokenizer = xt.xp.make_tokenizer()
    import gc
    import weakref

    import torch

    def build(shape, names=("dp", "sp", "tp"), dedup=True, dp="dp", **more):
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names) if shape else None
        config = xt.xp.text_config(data, num_workers=0, sp_media_dedup=dedup,
                                   config_class=spbcast.xtuner.DataloaderConfig, **more)
        return config.build(tokenizer=tokenizer, dp_mesh=mesh[dp] if mesh else None,
                            global_batch_size=shape[0] if shape else 1, micro_batch_size=1, seed=1)

    def outcome(make):
        try:
            return type(make()).__name__
        except spbcast.Error as e:
            return f"Error: {e}"

    results = {"tp2": outcome(lambda: build((1, 2, 2))),
               "not_xtuner_mesh": outcome(lambda: build((2, 2), names=("dp", "cp"))),
               "not_the_dp_dim": outcome(lambda: build((2, 2), names=("sp", "dp"))),
               "off": outcome(lambda: build((2, 2, 1), dedup=False)),
               "sp1": outcome(lambda: build((4, 1, 1))),
               # XTuner's RL prompt sampler builds without a mesh; its RL worker on (dp, sp).
               "no_mesh": outcome(lambda: build(None)),
               "rl_worker_mesh": outcome(lambda: build((2, 2), names=("dp", "sp"))),
               "dp_only_mesh": outcome(lambda: build((4,), names=("dp",)))}
    # What each rank holds after build: the leader its Dataloader and datasets, a follower nothing
    # (both are built on every rank, collectively, then dropped on followers).
    built = []
    dataloader_init = torch.utils.data.DataLoader.__init__

    def recording_init(self, dataset, *args, **kwargs):
        built.extend((weakref.ref(self), weakref.ref(dataset)))
        dataloader_init(self, dataset, *args, **kwargs)

    torch.utils.data.DataLoader.__init__ = recording_init
    try:
        loader = build((2, 2, 1))
    finally:
        torch.utils.data.DataLoader.__init__ = dataloader_init
    gc.collect()
    results["on"] = type(loader).__name__
    # The followers' patience: the SP group's own timeout, or the switch's field.
    sp_group = spbcast.xtuner._root_mesh(init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "sp", "tp")))["sp"].get_group()
    timeout = spbcast._broadcast._group_timeout(sp_group)
    results["root_wait"] = f"{loader.root_wait} of the group's {timeout}"
    results["root_wait_field"] = str(build((2, 2, 1), sp_media_dedup_root_wait=4000).root_wait)
    results["alive_after_build"] = sum(ref() is not None for ref in built), len(built)
    for name, state in (("no_sampler", {"dataset": {}, "total_consumed_samples": 0}),
                        ("unknown_version", {"version": 99, "loader": {}}), ("not_a_dict", [1])):
        results[name] = outcome(lambda: loader.load_state_dict(state))
    return results


def test_switch_refuses_what_it_cannot_do(tmp_path):
    import xtuner_trainer as xt

    _, data = xt.write_inputs(str(tmp_path))
    per_rank = xt.fork_ranks(str(tmp_path), "switch", lambda rank: _switch_checks(data))
    errors = ("tp2", "not_xtuner_mesh", "not_the_dp_dim", "no_sampler", "unknown_version", "not_a_dict")
    for rank, results in enumerate(per_rank):
        alive, built = results.pop("alive_after_build")
        assert built == 2 and alive == (2 if rank in LEADERS else 0), (
            f"rank {rank}: {alive} of the Dataloader and its dataset alive after build")
        for name in errors:
            assert results[name].startswith(f"Error: spbcast: rank {rank} "), f"{name}: {results[name]}"
        anonymous = {k: re.sub(r"rank \d+", "rank N", v) for k, v in results.items()}
        assert anonymous == {k: re.sub(r"rank \d+", "rank N", v) for k, v in per_rank[0].items()}, (
            f"rank {rank}'s outcomes differ from rank 0's: {results} != {per_rank[0]}")
    r = per_rank[0]
    assert r["off"] == r["sp1"] == r["no_mesh"] == r["dp_only_mesh"] == "Dataloader", (
        "off, at SP 1, without a mesh or an SP dimension: XTuner's own Dataloader")
    assert r["on"] == r["rl_worker_mesh"] == "XTunerLeaderLoader"
    waited, timeout = r["root_wait"].split(" of the group's ")
    assert float(waited) == float(timeout), r["root_wait"]  # the group's own patience
    assert r["root_wait_field"] == "4000.0"
    assert "requires TP size 1" in r["tp2"] and "tp_size=1" in r["tp2"], r["tp2"]
    for name in ("not_xtuner_mesh", "not_the_dp_dim"):
        assert "(dp, sp, tp)" in r[name] and "turn sp_media_dedup off" in r[name], r[name]
    assert "('dp', 'cp')" in r["not_xtuner_mesh"] and "(2, 2)" in r["not_xtuner_mesh"], r["not_xtuner_mesh"]
    assert "lacks 'sampler'" in r["no_sampler"], r["no_sampler"]
    assert "version 99" in r["unknown_version"], r["unknown_version"]
    assert "not the dict" in r["not_a_dict"], r["not_a_dict"]


def test_switch_needs_a_cpu_backend(tmp_path):
    """A job whose SP group has no CPU backend (here Gloo registered for CUDA only) is refused
    on every rank, naming the dist_backend to use."""
    import xtuner_trainer as xt

    _, data = xt.write_inputs(str(tmp_path))

    def check(rank):
        from torch.distributed.device_mesh import init_device_mesh

        import spbcast
        import spbcast.xtuner

        mesh = init_device_mesh("cpu", (2, 2, 1), mesh_dim_names=("dp", "sp", "tp"))
        config = xt.xp.text_config(data, num_workers=0, sp_media_dedup=True,
                                   config_class=spbcast.xtuner.DataloaderConfig)
        with pytest.raises(spbcast.Error, match="no CPU backend") as refused:
            config.build(tokenizer=xt.xp.make_tokenizer(), dp_mesh=mesh["dp"],
                         global_batch_size=2, micro_batch_size=1, seed=1)
        return str(refused.value)

    for message in xt.fork_ranks(str(tmp_path), "cuda-only", check, backend="cuda:gloo"):
        assert 'dist_backend="cpu:gloo,cuda:nccl"' in message, message


def test_a_dead_sp_leader_is_named_within_a_second(tmp_path):
    """XTuner's fit() under the switch with 2 persistent loader workers (which would keep the
    leader's sockets): the SP leader rank 0 is SIGKILLed while it waits for its next batch. Its
    follower rank 1 raises spbcast's error naming it within 1 s and exits within 1 s; ranks 2 and
    3 (the other SP pair) fail in the model's collectives, the backend's error - they only have
    to end; nothing of the job is left (docs/errors.md)."""
    import functools

    import peer_death
    import xtuner_trainer as xt

    root = str(tmp_path)
    tokenizer_dir, data = xt.write_inputs(root)
    victim, records, ended, ranks = peer_death.fork(
        functools.partial(xt.leader_dies, root, tokenizer_dir, data, 2), xt.WORLD)
    assert victim["pid"] == ranks[0].pid
    peer_death.assert_named(1, records[1], ended, victim, 0, "XTuner, 2 workers")
    for r in (2, 3):
        assert records[r]["error"] is not None, f"rank {r} finished training without its peers"
