"""spbcast.accelerate under TRL's real ``SFTTrainer`` (the version scripts/setup.sh pins): 4 Gloo
ranks on CPU with the device mesh (dp_shard 2, cp 2) given to the trainer's accelerator, BASE
(every rank loads) against dedup (``spbcast.accelerate.enable(trainer.accelerator)``: only the CP
leaders, ranks 0 and 2, load). Packing on, 2 DataLoader workers (persistent too), an evaluation
every 2 optimizer steps, a mid-epoch checkpoint, and the resume from it in new processes across
the switch: dedup from dedup's and from BASE's checkpoint, BASE from dedup's.

Per rank, bit for bit: every micro-step's packed inputs (input_ids, position_ids, labels) and loss,
every optimizer step's grad norm and generator, every evaluation's loss, len(), the final
parameters and generator; the resumed runs equal the continuous BASE run from the checkpoint on.
The followers' collators run no batch under dedup (trl_ranks.py)."""

import pytest

pytest.importorskip("trl", reason="TRL is not installed (scripts/setup.sh installs trl==0.29.1 into the main "
                    "environment)")
pytest.importorskip("accelerate", reason="accelerate is not installed (scripts/setup.sh installs it)")

from test_accelerate import TRAINER_KEYS, only_leaders_load, same_from_the_resume, same_run  # noqa: E402


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    import accelerate_ranks as ar
    import trl_ranks

    root = str(tmp_path_factory.mktemp("trl"))
    A = trl_ranks.SFTArm
    records = ar.run_arms(root, "continuous", [
        A("sft_base", False), A("sft_dedup", True),
        A("sft_base_persistent", False, persistent=True), A("sft_dedup_persistent", True, persistent=True)],
        timeout=240)
    records.update(ar.run_arms(root, "resumed", [  # new processes; "a@b": a resumed from what b saved
        A("sft_dedup@dedup", True, resume="sft_dedup"), A("sft_dedup@base", True, resume="sft_base"),
        A("sft_base@dedup", False, resume="sft_dedup")],
        timeout=240))
    return records


@pytest.mark.parametrize("arm", ["", "_persistent"])
def test_sft_trainer_equals_base(runs, arm):
    """Every rank's packed inputs, losses, grad norms, generator per step, evaluation losses, len(),
    final parameters and generator under dedup are BASE's, with and without persistent workers;
    the CP followers collate nothing, the leaders do."""
    base, dedup = runs[f"sft_base{arm}"], runs[f"sft_dedup{arm}"]
    same_run(base, dedup, f"sft{arm}", TRAINER_KEYS + ("eval_losses",))
    assert len(base[0]["eval_losses"]) >= 4
    assert all(r["fetches"] > 0 for r in base)
    only_leaders_load(f"sft_dedup{arm}", dedup)
    steps = base[0]["micro_steps"]
    assert len(base[0]["optimizer_steps"]) >= 6, "too few optimizer steps for a mid-epoch checkpoint"
    assert all("position_ids" in s["inputs"] for s in steps), "packing is off: no position_ids"
    # Packed rows: more than one sequence in a row (position_ids restart inside it).
    assert any(bool((s["inputs"]["position_ids"][..., 1:] == 0).any()) for s in steps), "no row holds two sequences"


def test_sft_trainer_resumes(runs):
    """resume_from_checkpoint at the mid-epoch checkpoint, in new processes: dedup from its own
    checkpoint and from BASE's, and BASE from dedup's, go on exactly as the continuous BASE run."""
    for resumed in ("sft_dedup@dedup", "sft_dedup@base", "sft_base@dedup"):
        same_from_the_resume(runs["sft_base"], runs[resumed], resumed)
        for rank, (e, g) in enumerate(zip(runs["sft_base"], runs[resumed])):
            assert e["eval_losses"][-len(g["eval_losses"]):] == g["eval_losses"], f"{resumed}, rank {rank}: eval"
        if resumed.startswith("sft_dedup"):
            only_leaders_load(resumed, runs[resumed])
