"""verl's real SFT trainer on 4 CPU Gloo ranks (dp 2 x sp 2), for test_verl.py and bench/verl_step.py.

Importing this module imports verl, transformers and tensordict once (seconds); ``run_arms`` then
forks the 4 ranks of one job from this process, and each rank runs several arms, one after the
other: verl's own ``SFTTrainer`` (its hydra configuration ``sft_trainer_engine``, its
``MultiTurnSFTDataset`` over a parquet file, its ``SFTTensorCollator`` with ``pad_mode:
no_padding``, its ``StatefulDataLoader`` over a ``DistributedSampler``, its ``fit()`` loop and its
``CheckpointHandler``) - the BASE arms first, then ``spbcast.verl.enable()`` (process-wide) and
the dedup arms. Each rank records what it saw.

Stood in for: verl's model engine alone (``SFTTrainer._build_engine``: its ``TrainingWorker``
and FSDP engine). verl 0.9.1 has no CPU platform: with no accelerator it falls back to
CUDA's, where its FSDP engine places the model, so the engine cannot train on these CPU ranks.
The stand-in builds the engine's real (dp, sp) Gloo device mesh with
``init_device_mesh`` exactly as ``FSDPEngine._init_device_mesh`` does, answers the engine's data
questions (dp rank and size, dp group, SP rank 0 as ``is_mp_src_rank_with_outputs``) as
``FSDPEngine`` does, records each batch ``fit()`` hands to ``train_batch`` (the TensorDict verl
built from the loader's batch) and returns a loss; its checkpoint holds nothing. And verl's
device memory probes (``log_gpu_memory_usage``, ``aggressive_empty_cache``: verl 0.9.1 has no CPU
platform and would ask CUDA), which only log and free device memory. Everything about
the data - dataset, collator, loader, sampler epochs, ``fit()``, the checkpoint handler's
``data_<dp>.pt`` and its resume - is verl's.

The model is a tiny Qwen2 written to a directory from a config (random weights, a word-level
tokenizer with a chat template); with ``multimodal``, a tiny Qwen2-VL with its tokenizer and
Qwen2-VL's image processor in its directory (tiny_qwen.py), which verl's ``hf_processor`` loads,
and conversations with an image (a PNG file) in each user turn, which verl's dataset fetches
(qwen_vl_utils) and processes. tiny_qwen.py's two shims stand in, the same in BASE and dedup, for
torchvision, which this environment lacks. Nothing is downloaded.
"""

import hashlib
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("WANDB_MODE", "disabled")

import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from tensordict import TensorDict  # noqa: E402
from tensordict.tensorclass import NonTensorData, NonTensorStack  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

import verl.trainer.sft_trainer as sft_trainer  # noqa: E402
import verl.utils.dataset.multiturn_sft_dataset as multiturn  # noqa: E402

import dist_harness  # noqa: E402
from calls_counted import CallCounter  # noqa: E402
import spbcast.verl  # noqa: E402
import tiny_qwen  # noqa: E402

# What this environment lacks for verl's image path (tiny_qwen.py), the same in BASE and dedup:
# torchvision, which qwen_vl_utils (verl's image fetch) imports; and, for verl's hf_processor,
# AutoProcessor of the Qwen2-VL directory (its video processor asks for torchvision).
tiny_qwen.bare_torchvision()
tiny_qwen.images_only_auto_processor()

WORLD, SP = 4, 2
LEADERS, FOLLOWERS = (0, 2), (1, 3)
SAMPLES = 24  # 2 dp ranks x 4 steps x batch 3 per dp rank
STEPS_PER_EPOCH = 4
WORDS = ["<unk>"] + [f"w{i}" for i in range(64)] + ["system", "user", "assistant"]
# After the words, no hole in the ids: a saved WordLevel vocabulary with holes reads back corrupted.
SPECIAL_TOKENS = {t: len(WORDS) + i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])}
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|> "
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


# The multimodal model's: Qwen2-VL's special tokens too, after the words (no hole in the ids).
VL_SPECIAL_TOKENS = {t: len(WORDS) + i for i, t in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
                                                              + tiny_qwen.VISION_TOKENS)}
# Qwen2-VL's way: an image is its vision tokens, where the message's content list has it.
VL_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<|vision_start|><|image_pad|>"
    "<|vision_end|>{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")


def make_tokenizer():
    return tiny_qwen.word_tokenizer(WORDS, SPECIAL_TOKENS, CHAT_TEMPLATE)


def write_model(directory):
    config = Qwen2Config(vocab_size=128, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    # A directory of its own (model.tokenizer_path): beside a Qwen2 config.json, transformers'
    # AutoTokenizer would read it as Qwen2's BPE tokenizer.
    make_tokenizer().save_pretrained(os.path.join(directory, "tokenizer"))


def write_vl_model(directory):
    """A tiny Qwen2-VL with its tokenizer and image processor in one directory, which verl's
    hf_processor reads (AutoProcessor, AutoConfig)."""
    tiny_qwen.write_qwen2_vl(directory, tiny_qwen.word_tokenizer(WORDS, VL_SPECIAL_TOKENS, VL_CHAT_TEMPLATE),
                             vocab_size=len(WORDS) + len(VL_SPECIAL_TOKENS))
    tiny_qwen.image_processor().save_pretrained(directory)


def write_dataset(directory, n=SAMPLES, seed=3, images=False):
    """Multi-turn conversations (verl's messages format) of varied lengths, as a parquet file. With
    ``images``: an image (a PNG file of varied size) in each user turn, in verl's images column."""
    rng = np.random.RandomState(seed)

    def words():
        return " ".join(f"w{j}" for j in rng.randint(0, 64, rng.randint(2, 14)))

    def image():
        if not images:
            return ""
        path = tiny_qwen.write_image(os.path.join(directory, f"image{i}-{len(paths)}.png"), rng)
        paths.append({"image": path})
        return "<image>"

    rows = []
    for i in range(n):
        paths = []
        turns = 2 if i % 3 == 0 else 1
        messages = [m for _ in range(turns) for m in ({"role": "user", "content": image() + words()},
                                                      {"role": "assistant", "content": words()})]
        rows.append({"messages": messages, **({"images": paths} if images else {})})
    path = os.path.join(directory, "train_vl.parquet" if images else "train.parquet")
    pd.DataFrame(rows).to_parquet(path)
    return path


# Every read of a sample (MultiTurnSFTDataset.__getitem__: read, tokenize, with a processor
# decode), in every process of a rank (DataLoader workers included).
READS = CallCounter(multiturn.MultiTurnSFTDataset, "__getitem__")


def digest(value):
    """What a batch holds, exactly: dtypes, shapes, strides, a nested tensor's layout, ragged
    dimension, values and offsets, non-tensor data."""
    if isinstance(value, torch.Tensor) and value.is_nested:
        return ("nested", str(value.layout), str(value.dtype), value._ragged_idx,
                digest(value.values()), digest(value.offsets()))
    if isinstance(value, torch.Tensor):
        data = value.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b""
        return ("tensor", str(value.dtype), tuple(value.shape), value.stride(), value.requires_grad,
                hashlib.sha256(data).hexdigest())
    if isinstance(value, NonTensorStack):
        return ("stack", digest(value.tolist()))
    if isinstance(value, NonTensorData):
        return ("data", digest(value.data))
    if isinstance(value, TensorDict):
        return ("tensordict", tuple(value.batch_size), {k: digest(value.get(k)) for k in sorted(value.keys())})
    if isinstance(value, dict):
        return {k: digest(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [digest(v) for v in value]
    return repr(value)


class _StandInEngine:
    """Stands in for verl's FSDP engine and its TrainingWorker (see the module's docstring): the
    real (dp, sp) Gloo mesh, FSDPEngine's answers about it, and a record of every batch."""

    def __init__(self, sp):
        self.sp = sp
        dp = dist.get_world_size() // sp
        self.ulysses_device_mesh = init_device_mesh("cpu", mesh_shape=(dp, sp), mesh_dim_names=["dp", "sp"])
        self.batches = []
        self.engine = self

    # FSDPEngine's data questions, answered as it answers them
    def is_mp_src_rank_with_outputs(self):
        return self.ulysses_device_mesh["sp"].get_local_rank() == 0

    def get_data_parallel_rank(self):
        return self.ulysses_device_mesh["dp"].get_local_rank()

    def get_data_parallel_size(self):
        return dist.get_world_size() // self.sp

    def get_data_parallel_group(self):
        return self.ulysses_device_mesh.get_group(mesh_dim="dp")

    # the checkpoint manager's: no model to save
    def save_checkpoint(self, local_path, global_step, max_ckpt_to_keep=None):
        os.makedirs(local_path, exist_ok=True)

    def load_checkpoint(self, path):
        pass

    # TrainingWorker's
    def set_loss_fn(self, loss_fn):
        pass

    def reset(self):
        pass

    def start_profile(self):
        pass

    def step_profile(self):
        pass

    def stop_profile(self):
        pass

    def train_batch(self, data):
        self.batches.append({"batch": digest(data), "rng": torch.get_rng_state()})
        loss = float(data["loss_mask"].values().sum()) if data["loss_mask"].is_nested else float(data["loss_mask"].sum())
        return TensorDict({"metrics": NonTensorData({"loss": loss})}, batch_size=[])


# verl 0.9.1 has no CPU platform (it falls back to CUDA's): its device memory probes, which the
# trainer only logs, would ask CUDA. Stood in for by nothing, in BASE and dedup alike.
sft_trainer.log_gpu_memory_usage = lambda *args, **kwargs: None
sft_trainer.aggressive_empty_cache = lambda *args, **kwargs: None


class RecordingSFTTrainer(sft_trainer.SFTTrainer):
    """verl's SFTTrainer with the engine stood in for (``_build_engine``); all else is verl's."""

    def _build_engine(self):
        sp = getattr(self.engine_config, "ulysses_sequence_parallel_size", 1)  # FSDPEngineConfig's
        self.training_client = self.engine = _StandInEngine(sp)


class Arm:
    """One run of verl's SFTTrainer on every rank: ``fit()`` for ``steps`` steps with a checkpoint
    every ``save_freq`` steps, or resumed from ``resume`` (an arm's name: its checkpoint after
    step ``save_freq``). A dedup arm calls ``spbcast.verl.enable(**options)``."""

    def __init__(self, name, dedup, workers=2, steps=6, save_freq=3, resume=None, options=None, sp=SP,
                 engine="fsdp", expect_error=False, pad_mode="no_padding", multimodal=False):
        self.name, self.dedup, self.workers, self.steps, self.save_freq = name, dedup, workers, steps, save_freq
        self.resume, self.options, self.sp, self.engine = resume, options or {}, sp, engine
        self.expect_error, self.pad_mode, self.multimodal = expect_error, pad_mode, multimodal


def checkpoint(root, arm, step=3):
    return os.path.join(root, arm, f"global_step_{step}")


def config(arm, root):
    directory = os.path.join(os.path.dirname(sft_trainer.__file__), "config")
    if arm.multimodal:  # the processor's directory is the model's: verl reads its config there too
        model = tokenizer = os.path.join(root, "model_vl")
    else:
        model, tokenizer = os.path.join(root, "model"), os.path.join(root, "model", "tokenizer")
    train = os.path.join(root, "data", "train_vl.parquet" if arm.multimodal else "train.parquet")
    overrides = [
        f"model.path={model}", f"model.tokenizer_path={tokenizer}", "model.use_remove_padding=true",
        f"data.train_files={train}", "data.val_files=null",
        f"data.train_batch_size={3 * WORLD // arm.sp}", "data.micro_batch_size_per_gpu=3",
        f"data.num_workers={arm.workers}", f"data.pad_mode={arm.pad_mode}", "data.max_length=256",
        f"engine={arm.engine}", "trainer.logger=[console]", f"trainer.total_training_steps={arm.steps}",
        "trainer.total_epochs=2", f"trainer.save_freq={arm.save_freq}",
        f"trainer.default_local_dir={os.path.join(root, arm.name)}",
        "trainer.resume_mode=" + ("resume_path" if arm.resume else "disable"), "trainer.device=cpu"]
    if arm.engine == "fsdp":  # the FSDP engine's Ulysses SP
        overrides.append(f"engine.ulysses_sequence_parallel_size={arm.sp}")
    if arm.resume:
        overrides.append(f"trainer.resume_from_path={checkpoint(root, arm.resume, arm.save_freq)}")
    with initialize_config_dir(config_dir=directory, version_base=None):
        return compose(config_name="sft_trainer_engine", overrides=overrides)


def _run_arm(arm, rank, root):
    record = {"error": None}
    READS.start(os.path.join(root, f"reads-{arm.name}-rank{rank}"))
    torch.manual_seed(1234)  # every arm from the same generator, every rank alike
    try:
        if arm.dedup:
            spbcast.verl.enable(**arm.options)
        trainer = RecordingSFTTrainer(config(arm, root))
        record["len"] = len(trainer.train_dataloader)
        record["class"] = type(trainer.train_dataloader).__name__
        trainer.fit()
        record["steps"] = trainer.engine.batches
        record["rng"] = torch.get_rng_state()
        record["stats"] = spbcast.verl.stats(trainer.train_dataloader)
        record["state"] = trainer.train_dataloader.state_dict()
    except Exception as e:  # noqa: BLE001 - recorded for the test to judge
        if not arm.expect_error:
            raise
        record["error"] = f"{type(e).__name__}: {e}"
    READS.stop()
    record["reads"], record["reads_in_workers"] = READS.count()
    return record


def prepare(root, arms):
    """The models and the datasets the arms need, once per job root."""
    os.makedirs(os.path.join(root, "data"), exist_ok=True)
    if not os.path.exists(os.path.join(root, "model", "config.json")):
        write_model(os.path.join(root, "model"))
        write_dataset(os.path.join(root, "data"))
    if any(arm.multimodal for arm in arms) and not os.path.exists(os.path.join(root, "model_vl", "config.json")):
        write_vl_model(os.path.join(root, "model_vl"))
        write_dataset(os.path.join(root, "data"), images=True)


def run_arms(root, tag, arms, timeout=170):
    """Forks one job of WORLD ranks whose ranks run ``arms`` in turn (dist_harness.run_arms);
    returns {arm name: [record per rank]}."""
    prepare(root, arms)
    return dist_harness.run_arms(WORLD, _run_arm, root, tag, arms, timeout=timeout)
