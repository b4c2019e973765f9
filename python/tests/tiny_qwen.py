"""Tiny Qwen models and their tokenizers and processors, made locally for the trainers' tests
(swift_ranks.py, verl_ranks.py): random weights from a config, a word-level tokenizer, Qwen2-VL's
image processor. Nothing is downloaded.

Two shims for what these environments lack, the same in BASE and dedup: torchvision (no CPU wheel
for this torch on PyPI; qwen_vl_utils imports it at module level and uses it for videos only) is
a bare module, and Qwen2-VL's processor goes without a video processor (transformers' needs
torchvision).
"""

import sys
import types

import numpy as np
import torch
from PIL import Image
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
from transformers import (AutoProcessor, AutoTokenizer, PreTrainedTokenizerFast, Qwen2VLConfig,
                          Qwen2VLForConditionalGeneration, Qwen2VLProcessor)
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def bare_torchvision():
    """qwen_vl_utils imports torchvision (io, transforms.InterpolationMode) for its video readers;
    the images path never calls it. Install it after transformers and datasets asked whether
    torchvision is there (they find it is not)."""
    if "torchvision" in sys.modules:
        return
    tv = types.ModuleType("torchvision")
    tv.__version__ = "0.0"
    tv.io = types.ModuleType("torchvision.io")
    tv.transforms = types.ModuleType("torchvision.transforms")
    tv.transforms.InterpolationMode = types.SimpleNamespace(BICUBIC="bicubic", BILINEAR="bilinear")
    sys.modules.update({"torchvision": tv, "torchvision.io": tv.io, "torchvision.transforms": tv.transforms})


def word_tokenizer(words, special_tokens, chat_template=None):
    """A word-level tokenizer over ``words`` (ids in order) and ``special_tokens`` ({token: id}).
    One that is saved and read back needs ids without holes: a saved WordLevel vocabulary with
    holes reads back corrupted."""
    vocab = {word: i for i, word in enumerate(words)}
    vocab.update(special_tokens)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special_tokens])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<|endoftext|>",
                                        eos_token="<|im_end|>")
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


class ImagesOnlyQwen2VLProcessor(Qwen2VLProcessor):
    """Qwen2-VL's processor without a video processor (transformers' needs torchvision). Named as
    Qwen2-VL's: trainers pick their position ids by the processor's class name."""

    def check_argument_for_proper_class(self, argument_name, argument):
        return None if argument is None else super().check_argument_for_proper_class(argument_name, argument)

    def save_pretrained(self, save_directory, **kwargs):  # a checkpoint's copy, never read back here
        self.tokenizer.save_pretrained(save_directory)
        self.image_processor.save_pretrained(save_directory)


ImagesOnlyQwen2VLProcessor.__name__ = ImagesOnlyQwen2VLProcessor.__qualname__ = "Qwen2VLProcessor"


def image_processor(max_pixels=28 * 28 * 16):
    return Qwen2VLImageProcessorPil(patch_size=14, merge_size=2, temporal_patch_size=2,
                                    min_pixels=28 * 28 * 4, max_pixels=max_pixels)


def images_only_processor(tokenizer, images, chat_template=None):
    return ImagesOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None,
                                      chat_template=chat_template or tokenizer.chat_template)


_AUTO_PROCESSOR = AutoProcessor.from_pretrained.__func__


def _from_pretrained(cls, path, *args, **kwargs):
    try:
        return _AUTO_PROCESSOR(cls, path, *args, **kwargs)
    except ImportError:  # Qwen2-VL's video processor asks for torchvision: the images-only one
        images = Qwen2VLImageProcessorPil.from_pretrained(path)
        return images_only_processor(AutoTokenizer.from_pretrained(path), images)


def images_only_auto_processor():
    """``AutoProcessor.from_pretrained`` of a Qwen2-VL directory, where transformers would fail
    for want of torchvision: the images-only processor, from the directory's image processor and
    tokenizer (for trainers that load the processor themselves)."""
    AutoProcessor.from_pretrained = classmethod(_from_pretrained)


def write_qwen2_vl(directory, tokenizer, vocab_size):
    """A tiny Qwen2-VL (1 text layer, 1 vision block, 2 KV heads: SP 2 is plain Ulysses) and
    ``tokenizer``, with its special tokens at the tokenizer's ids."""
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ["<|endoftext|>", "<|im_end|>"] + VISION_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=32, num_heads=2, mlp_ratio=2, patch_size=14,
                           spatial_merge_size=2, temporal_patch_size=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"])
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def write_image(path, rng, side=None):
    """A PNG of random pixels: ``side`` x ``side``, or of a size drawn from ``rng`` (multiples of
    28 pixels, 2 to 4 of them a side)."""
    h, w = (side, side) if side else (28 * rng.randint(2, 5), 28 * rng.randint(2, 5))
    Image.fromarray(rng.randint(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return path
