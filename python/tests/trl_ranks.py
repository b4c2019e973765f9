"""TRL's real ``SFTTrainer.train()`` on 4 CPU ranks, for test_trl.py, run as accelerate_ranks.py
runs the Trainer: the ranks forked from the importing process, the (dp_shard 2, cp 2) device mesh
given to the trainer's accelerator, BASE (TRL and accelerate as shipped) against dedup
(``spbcast.accelerate.enable(trainer.accelerator)``).

Nothing is downloaded: the model is a Llama of one layer built from a config, the tokenizer a
word-level one built from a vocabulary, the dataset text made here. SFTTrainer tokenizes it, appends
EOS and packs it (``packing=True``: best-fit decreasing into rows of MAX_LENGTH tokens, padding-free
batches with position_ids), and its collator runs in 2 DataLoader workers. An eval dataset (the
first EVAL_TEXTS lines, packed too) is evaluated every 2 optimizer steps: the accelerator prepares
its loader as well, and spbcast shares it as it shares the train loader.
"""

import dataclasses
import multiprocessing
import os

import datasets
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback
from trl import SFTConfig, SFTTrainer

import accelerate_ranks as ar

TEXTS = 60  # about 36 packed rows: 4-5 optimizer steps an epoch (2 data indices x 2 rows x 2 micro-steps)
MAX_LENGTH = 16
WORDS = 40
EVAL_TEXTS = 20


@dataclasses.dataclass
class SFTArm:
    """One ``SFTTrainer.train()``: 2 epochs of the packed TEXTS, 2 rows per device, gradient
    accumulation 2, 2 workers, an evaluation every 2 and a checkpoint every MID optimizer steps;
    ``resume``: the arm whose checkpoint-MID it resumes from (new processes)."""
    name: str
    dedup: bool
    resume: str | None = None
    workers: int = 2
    shared_dim: str = "cp"
    # Persistent workers: BASE's own resume is not exact with them (the resumed run's generator
    # leaves the continuous run's at its first evaluation), so only continuous runs use them.
    persistent: bool = False


def tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, **{f"w{i}": 3 + i for i in range(WORDS)}}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def texts():
    """TEXTS lines of 3 to 12 words, the same in every process."""
    g = torch.Generator().manual_seed(11)
    lengths = torch.randint(3, 13, (TEXTS,), generator=g).tolist()
    return [" ".join(f"w{i}" for i in torch.randint(0, WORDS, (n,), generator=g).tolist()) for n in lengths]


class CountingCollator:
    """SFTTrainer's collator, counting its calls in every process of this rank (its workers
    included): a follower under dedup collates no batch."""

    def __init__(self, collate):
        self.collate = collate
        self.calls = multiprocessing.get_context("fork").Value("i", 0)

    def __call__(self, examples):
        with self.calls.get_lock():
            self.calls.value += 1
        return self.collate(examples)


class _Evaluations(TrainerCallback):
    def __init__(self, record):
        self.record = record

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.record["eval_losses"].append(metrics["eval_loss"])


def _sft(arm, rank, mesh, root):
    args = SFTConfig(output_dir=os.path.join(root, arm.name), per_device_train_batch_size=2,
                     per_device_eval_batch_size=2, gradient_accumulation_steps=2, num_train_epochs=2,
                     save_strategy="steps", save_steps=ar.MID, eval_strategy="steps", eval_steps=2,
                     logging_strategy="no", use_cpu=True, seed=ar.SEED, report_to=[],
                     dataloader_num_workers=arm.workers, dataloader_persistent_workers=arm.persistent,
                     disable_tqdm=True, packing=True, max_length=MAX_LENGTH)
    record = {"micro_steps": [], "optimizer_steps": [], "eval_losses": []}
    lines = texts()
    trainer = SFTTrainer(model=ar.tiny_llama(vocab_size=3 + WORDS), args=args,
                         train_dataset=datasets.Dataset.from_dict({"text": lines}),
                         eval_dataset=datasets.Dataset.from_dict({"text": lines[:EVAL_TEXTS]}),
                         processing_class=tokenizer(), callbacks=[ar._Recorder(record), _Evaluations(record)])
    trainer.data_collator = collator = CountingCollator(trainer.data_collator)
    ar.train_recorded(trainer, arm, mesh, root, record)
    record["fetches"] = collator.calls.value
    return record


ar.RUNNERS[SFTArm] = _sft
