"""spbcast.accelerate under TRL's real ``SFTTrainer`` (the version scripts/setup.sh pins): 4 Gloo
ranks on CPU with the device mesh (dp_shard 2, cp 2) given to the trainer's accelerator, BASE
(every rank loads) against dedup (``spbcast.accelerate.enable(trainer.accelerator)``: only the CP
leaders, ranks 0 and 2, load). Packing on, 2 DataLoader workers, a mid-epoch checkpoint, and the
resume from it in new processes across the switch: dedup from dedup's and from BASE's checkpoint,
BASE from dedup's.

Per rank, bit for bit: every micro-step's packed inputs (input_ids, position_ids, labels) and loss,
every optimizer step's grad norm and generator, len(), the final parameters and generator; the
resumed runs equal the continuous BASE run from the checkpoint on. The followers' collators run no
batch under dedup (trl_ranks.py)."""

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
    records = ar.run_arms(root, "continuous", [A("sft_base", False), A("sft_dedup", True)], timeout=240)
    records.update(ar.run_arms(root, "resumed", [  # new processes; "a@b": a resumed from what b saved
        A("sft_dedup@dedup", True, resume="sft_dedup"), A("sft_dedup@base", True, resume="sft_base"),
        A("sft_base@dedup", False, resume="sft_dedup")],
        timeout=240))
    return records


def test_sft_trainer_equals_base(runs):
    """Every rank's packed inputs, losses, grad norms, generator per step, len(), final parameters
    and generator under dedup are BASE's; the CP followers collate nothing, the leaders do."""
    base, dedup = runs["sft_base"], runs["sft_dedup"]
    same_run(base, dedup, "sft", TRAINER_KEYS)
    assert all(r["fetches"] > 0 for r in base)
    only_leaders_load("sft_dedup", dedup)
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
        if resumed.startswith("sft_dedup"):
            only_leaders_load(resumed, runs[resumed])
