"""XTuner v1's data pipeline, built for the integration tests (test_xtuner.py) on a CPU machine.

Importing this module imports XTuner v1's data code: call ``xtuner_available.unavailable()``
first (it imports nothing heavy) and skip when it gives a reason. ``xtuner.v1.datasets``'s own ``__init__`` imports
the model and RL code (GPU kernels), so the package is registered as a bare module with its
``__path__`` and only the submodules the data pipeline needs are imported - what a CPU data
process of XTuner runs. Everything else is XTuner's own: ``DataloaderConfig.build`` (JsonlDataset,
the packing datasets, LengthGroupedSampler / ParallelSampler, its ``Dataloader`` with forked
persistent workers), its collators and ``SequenceContext``, its 3-D rope index for Qwen3-VL.

There is no model download: the tokenizer is a WordLevel vocabulary built in memory by
``tokenizers`` and wrapped in ``transformers.PreTrainedTokenizerFast``; the Qwen3-VL images are
made from a seed and go through transformers' Qwen2-VL image processor (its PIL backend; Qwen3-VL
uses it with 16-pixel patches), so ``pixel_values`` and ``image_grid_thw`` have the real layout.
"""

import importlib
import importlib.util
import json
import os
import sys
import types

from xtuner_available import unavailable  # noqa: F401 - the check, for callers

# The submodules XTuner v1's data pipeline runs (the package's own __init__ is not run).
_SUBMODULES = ("collator", "dataloader", "sampler", "packing", "jsonl", "config", "utils",
               "data_item", "pt_tokenize_fn", "mllm_tokenize_fn.qwenvl_rope2d")


def _bare_package(name):
    """Registers package `name` without running its __init__ (its submodules import as usual)."""
    if name in sys.modules:
        return sys.modules[name]
    parent, _, child = name.rpartition(".")
    spec = importlib.util.find_spec(name)
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    module.__package__ = name
    sys.modules[name] = module
    setattr(sys.modules[parent], child, module)
    return module


def _load():
    os.environ.setdefault("XTUNER_TOKENIZE_WORKERS", "1")  # tokenize in-process (no pool)
    import xtuner.v1  # noqa: F401 - its own __init__ is CPU-safe
    _bare_package("xtuner.v1.datasets")
    _bare_package("xtuner.v1.datasets.mllm_tokenize_fn")
    return {name: importlib.import_module(f"xtuner.v1.datasets.{name}") for name in _SUBMODULES}


XT = types.SimpleNamespace(**{k.replace(".", "_"): v for k, v in _load().items()})

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast  # noqa: E402
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize  # noqa: E402
from xtuner.v1.data_proto.sequence_context import DSATopKCacheState, SequenceContext  # noqa: E402

import spbcast  # noqa: E402

# What XTuner's batches hold besides dicts, lists and tensors; every rank, at import time.
spbcast.allow_classes(SequenceContext, DSATopKCacheState)

DataloaderConfig = XT.config.DataloaderConfig
DatasetConfig = XT.config.DatasetConfig
PretrainTokenizeFunctionConfig = XT.pt_tokenize_fn.PretrainTokenizeFunctionConfig
XTunerDataloader = XT.dataloader.Dataloader

WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["<unk>", "<pad>", "<s>", "</s>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]


def make_tokenizer():
    vocab = {t: i for i, t in enumerate(SPECIAL + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   bos_token="<s>", eos_token="</s>",
                                   additional_special_tokens=SPECIAL[4:])


def write_text_data(directory, n=40, seed=0, name="text.jsonl"):
    """Pretraining samples of 4..40 words (XTuner's {"messages": [{"role": "pretrain", ...}]})."""
    rng = np.random.default_rng(seed)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        for _ in range(n):
            words = rng.choice(WORDS, size=int(rng.integers(4, 41)))
            f.write(json.dumps({"messages": [{"role": "pretrain", "content": " ".join(words)}]}) + "\n")
    return path


def write_vl_data(directory, n=24, seed=1, name="vl.jsonl"):
    """Image-text samples: an image (height, width, seed) and 3..20 words around it."""
    rng = np.random.default_rng(seed)
    path = os.path.join(directory, name)
    with open(path, "w") as f:
        for _ in range(n):
            h, w = (int(x) for x in rng.choice([32, 64, 96], size=2))
            words = " ".join(rng.choice(WORDS, size=int(rng.integers(3, 21))))
            f.write(json.dumps({"image": [h, w, int(rng.integers(1 << 30))], "text": words}) + "\n")
    return path


class TinyQwen3VLTokenizeFunction(XT.utils.CachableTokenizeFunction):
    """A Qwen3-VL sample as XTuner's Qwen3VLTokenizeFunction returns it (QwenVL3DataItem: input_ids
    with <|vision_start|> <|image_pad|>*n <|vision_end|>, labels, num_tokens, num_img_tokens,
    num_imgs, pixel_values, image_grid_thw, and the 3-D rope position_ids from XTuner's
    get_rope_index_3), from an image made from a seed, through transformers' Qwen2-VL image
    processor (16-pixel patches, merge 2, as Qwen3-VL). The real tokenize function loads its
    processor with AutoProcessor.from_pretrained (a model directory and torchvision's video
    processor); this one needs neither. With ``noise`` the pixels get an augmentation drawn from
    the default CPU generator (in the DataLoader worker, or in the main process with 0 workers,
    where LeaderLoader must mirror the draws)."""

    def __init__(self, tokenizer, noise=True):
        super().__init__(tokenizer)
        self.noise = noise
        self.pixels = (32 * 32, 96 * 96)
        self.processor = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                                  min_pixels=self.pixels[0], max_pixels=self.pixels[1])
        ids = tokenizer.convert_tokens_to_ids
        self.start_id, self.end_id, self.image_id = (ids(t) for t in SPECIAL[4:])

    def __call__(self, item, **kwargs):
        h, w, seed = item["image"]
        text = self.tokenizer.encode(item["text"], add_special_tokens=False)
        if self.state == "cache":  # the lengths only, as XTuner's smart_get_thw
            rh, rw = smart_resize(h, w, factor=32, min_pixels=self.pixels[0], max_pixels=self.pixels[1])
            n_img = (rh // 32) * (rw // 32)
            n = n_img + len(text) + 3
            return {"num_tokens": n, "num_img_tokens": [n_img], "proxy_attn_flops": float(n)}
        image = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
        processed = self.processor(images=[image], return_tensors="pt")
        pixel_values, thw = processed["pixel_values"], processed["image_grid_thw"]
        n_img = int(thw.prod()) // 4
        input_ids = [self.start_id] + [self.image_id] * n_img + [self.end_id] + text + [
            self.tokenizer.eos_token_id]
        labels = [-100] * (n_img + 2) + text + [self.tokenizer.eos_token_id]
        if self.noise:
            pixel_values = pixel_values + 0.01 * torch.rand(pixel_values.shape)
        position_ids = XT.mllm_tokenize_fn_qwenvl_rope2d.get_rope_index_3(
            torch.tensor(input_ids).unsqueeze(0), image_grid_thw=thw, image_token_id=self.image_id,
            vision_start_token_id=self.start_id, spatial_merge_size=2)
        return {"input_ids": input_ids, "labels": labels, "num_tokens": len(input_ids),
                "num_img_tokens": [n_img], "num_imgs": [1], "pixel_values": pixel_values,
                "image_grid_thw": thw, "position_ids": position_ids}

    def hash(self):
        return f"tiny-qwen3-vl-{self.noise}"


class TinyQwen3VLTokenizeFnConfig:
    """Satisfies XTuner's BaseTokenizeFnConfig protocol (build(tokenizer, ...))."""

    def __init__(self, noise=True):
        self.noise = noise

    def build(self, tokenizer, tokenizer_hash=None, anno_name=None, **kwargs):
        return TinyQwen3VLTokenizeFunction(tokenizer, self.noise)


def text_config(path, *, num_workers, pack_level="soft", group_by_length=True, pack_max_length=64,
                config_class=None, **more):
    """XTuner's text pipeline; ``config_class`` is XTuner's DataloaderConfig or a subclass."""
    return (config_class or DataloaderConfig)(
        dataset_config_list=[{"dataset": DatasetConfig(anno_path=path, name="text"),
                              "tokenize_fn": PretrainTokenizeFunctionConfig()}],
        collator="sft_llm_collator", pack_level=pack_level, group_by_length=group_by_length,
        pack_max_length=pack_max_length, pack_workers=1, pack_chunk_size=16,
        pack_extra_buffer_size=4, num_workers=num_workers, pad_token_id=1, tokenizer_hash="tiny",
        **more)


def vl_config(path, *, num_workers, pack_max_length=128):
    return DataloaderConfig(
        dataset_config_list=[{"dataset": DatasetConfig(anno_path=path, name="vl"),
                              "tokenize_fn": TinyQwen3VLTokenizeFnConfig()}],
        collator="qwen3_vl_sft_collator", pack_level="soft", group_by_length=True,
        pack_max_length=pack_max_length, pack_workers=1, pack_chunk_size=16,
        pack_extra_buffer_size=4, num_workers=num_workers, pad_token_id=1, tokenizer_hash="tiny")


def use_cache_dir(path):
    """Where XTuner's packing writes its shared mmap files (default /dev/shm/xtuner_mmap_<uid>,
    which outlives the run): the test's own directory."""
    from pathlib import Path

    os.makedirs(path, exist_ok=True)
    XT.utils._MMAP_DIR = Path(path)


def set_random_seed(seed):
    """mmengine.runner.set_random_seed, which XTuner's Trainer calls at start, on a CPU machine."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
