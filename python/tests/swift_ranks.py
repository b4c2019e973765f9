"""ms-swift's real SP data path and SP trainer on 4 CPU Gloo ranks (SP 2 x DP 2), for test_swift.py
and bench/swift_step.py.

Importing this module imports ms-swift, transformers and datasets once (seconds); ``run_arms``
then forks the 4 ranks of one job from this process, and each rank runs several arms, one after
the other, through ms-swift's own ``swift sft`` pipeline (``SwiftSft``: model and processor
loading, the dataset and its ``LazyLLMDataset`` with the template's encoding, the SP mesh, the
trainer): the BASE arms first, then ``spbcast.swift.enable()`` (process-wide) and the dedup arms.
Each rank records what it saw.

The model is a tiny Qwen2-VL written to a directory from a config (tiny_qwen.py: random weights,
a word-level tokenizer holding Qwen2-VL's special tokens at their ids); the images are PNG files
made from a seed. Nothing is downloaded. tiny_qwen.py's two shims stand in, the same in BASE and
dedup, for what this environment lacks (torchvision); ms-swift is given the images-only
processor, built in code.
"""

import hashlib
import json
import os
import signal

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("MODELSCOPE_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import swift.dataset.utils  # noqa: E402
import swift.model.register  # noqa: E402
import swift.template  # noqa: E402
import transformers.trainer  # noqa: E402
from swift.pipelines.train.sft import SwiftSft  # noqa: E402

import tiny_qwen  # noqa: E402

tiny_qwen.bare_torchvision()  # after transformers and datasets looked for torchvision

import dist_harness  # noqa: E402
import peer_death_ranks  # noqa: E402
from calls_counted import CallCounter  # noqa: E402
import spbcast  # noqa: E402
import spbcast.swift  # noqa: E402

WORLD, SP = 4, 2
LEADERS, FOLLOWERS = (0, 2), (1, 3)
SAMPLES = 13  # not a multiple of the 2 data ranks: SequenceParallelSampler rounds up
SPECIAL_TOKENS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                  "<|vision_start|>": 151652, "<|vision_end|>": 151653, "<|image_pad|>": 151655,
                  "<|video_pad|>": 151656}
WORDS = ["<unk>"] + [f"w{i}" for i in range(64)] + ["system", "user", "assistant", "You", "are", "a",
                                                   "helpful", "Describe", "the", "image", "."]


def make_tokenizer():
    return tiny_qwen.word_tokenizer(WORDS, SPECIAL_TOKENS)


# The image processor's bound on an image's pixels (the bench raises it for larger images).
IMAGE_MAX_PIXELS = {"value": 28 * 28 * 16}


def make_processor():
    chat = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tiny_qwen.images_only_processor(make_tokenizer(), tiny_qwen.image_processor(IMAGE_MAX_PIXELS["value"]),
                                           chat)


def _processor_in_code(loader, model_dir, config):
    return make_processor()


# ms-swift's loader would read the processor from the model directory with AutoProcessor.
swift.model.register.ModelLoader.get_processor = _processor_in_code


def write_model(directory):
    tiny_qwen.write_qwen2_vl(directory, make_tokenizer(), vocab_size=151680)


def write_dataset(directory, n=SAMPLES, seed=3, side=None):
    """Image-and-text conversations (ms-swift's messages format) with PNG images: of varied sizes,
    or ``side`` x ``side`` pixels."""
    rng = np.random.RandomState(seed)
    path = os.path.join(directory, "train.jsonl")
    with open(path, "w") as f:
        for i in range(n):
            image = tiny_qwen.write_image(os.path.join(directory, f"image{i}.png"), rng, side)
            words = " ".join(f"w{j}" for j in rng.randint(0, 64, rng.randint(3, 12)))
            f.write(json.dumps({"messages": [{"role": "user", "content": "<image>Describe the image ."},
                                             {"role": "assistant", "content": words}],
                                "images": [image]}) + "\n")
    return path


# Every encode of a sample, in every process of a rank (DataLoader workers included), from the
# time a record starts.
ENCODES = CallCounter(swift.dataset.utils.LazyLLMDataset, "__getitem__")


class Arm:
    """One run of ms-swift's pipeline on every rank. kind "loader": the trainer's train loader,
    two epochs as the Trainer drives them, then ms-swift's resume path (skip 2 batches);
    "train": ``trainer.train()`` (max_steps, a checkpoint every ``save_steps``), or resumed
    from ``resume`` (a checkpoint directory, relative to the job's root). A dedup arm calls
    ``spbcast.swift.enable()``, or with ``plugin`` gives ms-swift spbcast's plugin file."""

    def __init__(self, name, dedup, kind="loader", workers=0, max_steps=4, save_steps=2, resume=None,
                 options=None, streaming=False, expect_error=False, batch_size=1, plugin=False):
        self.name, self.dedup, self.kind, self.workers, self.batch_size = name, dedup, kind, workers, batch_size
        self.max_steps, self.save_steps, self.resume = max_steps, save_steps, resume
        self.options, self.streaming, self.expect_error = options or {}, streaming, expect_error
        self.plugin = plugin  # dedup through the CLI's way: --external_plugins (instead of enable())


def sft_arguments(arm, root):
    args = ["--model", os.path.join(root, "model"), "--model_type", "qwen2_vl", "--template", "qwen2_vl", "--torch_dtype", "float32",
            "--attn_impl", "sdpa", "--dataset", os.path.join(root, "data", "train.jsonl"),
            "--split_dataset_ratio", "0", "--tuner_type", "full", "--sequence_parallel_size", str(SP),
            "--per_device_train_batch_size", str(arm.batch_size), "--gradient_accumulation_steps", "1",
            "--dataloader_num_workers", str(arm.workers), "--max_steps", str(arm.max_steps),
            "--save_steps", str(arm.save_steps), "--logging_steps", "1", "--learning_rate", "1e-3",
            "--output_dir", os.path.join(root, arm.name), "--add_version", "false", "--report_to", "none",
            "--seed", "42", "--max_length", "512", "--use_cpu", "true", "--save_only_model", "false",
            "--dataset_num_proc", "1", "--check_model", "false",
            "--load_from_cache_file", "false", "--warmup_ratio", "0", "--dataloader_persistent_workers", "false"]
    args += ["--streaming", "true"] if arm.streaming else ["--lazy_tokenize", "true"]
    if arm.resume:
        args += ["--resume_from_checkpoint", os.path.join(root, arm.resume)]
    if arm.plugin:
        args += ["--external_plugins", spbcast.swift.plugin_path()]
    return args


def _digest(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape),
                hashlib.sha256(value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
                if value.numel() else "")
    if isinstance(value, dict):
        return {k: _digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_digest(v) for v in value]
    return repr(value)


def _loader_record(trainer, record):
    loader = trainer.get_train_dataloader()
    record["len"] = len(loader)
    record["epochs"] = []
    for epoch in range(2):
        loader.set_epoch(epoch)  # as transformers' _run_epoch
        batches = [_digest(batch) for batch in loader]
        record["epochs"].append({"batches": batches, "rng": torch.get_rng_state(),
                                 "encodes": ENCODES.count()[0]})
    # ms-swift's resume path: the Trainer's skip_first_batches, patched by ms-swift to rebuild the
    # loader through get_train_dataloader(skip_batches=n).
    with trainer._patch_skip_first_batches():
        skipped = transformers.trainer.skip_first_batches(loader, 2)
    skipped.set_epoch(1)
    record["skipped"] = {"len": len(skipped), "batches": [_digest(batch) for batch in skipped],
                         "rng": torch.get_rng_state(), "encodes": ENCODES.count()[0]}
    record["stats"] = spbcast.swift.stats(loader)


def _train_record(trainer, record):
    record["inputs"] = inputs = []
    training_step = trainer.training_step

    def recorded_training_step(model, batch, *args, **kwargs):
        inputs.append(_digest(batch))  # as the loader gave it, before ms-swift splits it
        return training_step(model, batch, *args, **kwargs)

    trainer.training_step = recorded_training_step
    trainer.train(trainer.args.resume_from_checkpoint)
    record["losses"] = [(log["step"], log["loss"]) for log in trainer.state.log_history if "loss" in log]
    record["parameters"] = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    record["rng"] = torch.get_rng_state()
    record["stats"] = spbcast.swift.stats(trainer.callback_handler.train_dataloader)


def _run_arm(arm, rank, root):
    record = {"error": None}

    def train(trainer):
        ENCODES.start(os.path.join(root, f"encodes-{arm.name}-rank{rank}"))
        (_loader_record if arm.kind == "loader" else _train_record)(trainer, record)
        ENCODES.stop()
        record["encodes"], record["encodes_in_workers"] = ENCODES.count()

    try:
        if arm.dedup and not arm.plugin:
            spbcast.swift.enable(**arm.options)
        pipeline = SwiftSft(sft_arguments(arm, root))
        pipeline.train = train
        pipeline.main()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        if not arm.expect_error:
            raise
        record["error"] = f"{type(e).__name__}: {e}"
    return record


def _environment(rank):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT="1")


def checkpoint(root, arm, step=2):
    return os.path.join(root, arm, f"checkpoint-{step}")


def prepare(root):
    """The model and the dataset, once per job root."""
    if not os.path.exists(os.path.join(root, "model", "config.json")):
        os.makedirs(os.path.join(root, "data"), exist_ok=True)
        write_model(os.path.join(root, "model"))
        write_dataset(os.path.join(root, "data"))


def run_arms(root, tag, arms, timeout=170):
    """Forks one job of WORLD ranks whose ranks run ``arms`` in turn (dist_harness.run_arms);
    returns {arm name: [record per rank]}."""
    prepare(root)
    return dist_harness.run_arms(WORLD, _run_arm, root, tag, arms, timeout=timeout, prepare=_environment)


def leader_dies(root, workers, rank, out):
    """One rank of test_swift.py's kill test (forked by peer_death.fork): ms-swift's SP training
    under ``spbcast.swift.enable()`` whose SP leader rank 0 SIGKILLs itself 0.2 s after optimizer
    step 2, while it waits for its next batch. The leader's samples take ENCODE_SECONDS each to
    encode, far longer than a step (with 2 workers the third batch is ready 2 x ENCODE_SECONDS
    after the start, step 2 ends about ENCODE_SECONDS + 2 steps after it), so its SP follower
    waits in the loader too, where spbcast is the one to see the death; killed in the middle of
    the model's own all-to-all, the follower would get the backend's error first. Each survivor
    records what it raised (peer_death_ranks.survive)."""
    _environment(rank)
    peer_death_ranks.join_group(rank, WORLD, out)
    peer_death_ranks.slow_down(swift.dataset.utils.LazyLLMDataset, "__getitem__", ENCODE_SECONDS)

    class Kill(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if rank == 0 and state.global_step == 2:
                peer_death_ranks.end_myself(out, signal.SIGKILL, when=0.2)

    def train(trainer):
        trainer.add_callback(Kill())
        peer_death_ranks.survive(out, rank, trainer.train, torch.distributed.destroy_process_group)

    spbcast.swift.enable()
    pipeline = SwiftSft(sft_arguments(Arm("dies", True, kind="train", workers=workers, max_steps=6,
                                          save_steps=100), root))
    pipeline.train = train
    pipeline.main()


ENCODE_SECONDS = 3.0
