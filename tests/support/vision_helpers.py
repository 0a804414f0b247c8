"""A tiny random-weight Qwen2.5-VL for tests, saved with its processor (tokenizer, image processor, chat template),
and small images to send it."""
from __future__ import annotations

import functools
import io
import os
import shutil

import torch


# Qwen2.5-VL's own chat template (an image part becomes <|vision_start|><|image_pad|><|vision_end|>), without the
# video branch.
QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}{% if loop.first and "
    "message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content or "
    "'image_url' in content %}{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_processor():
    """The default model's tokenizer with the vision tokens and Qwen2.5-VL's chat template added, and Qwen2-VL's
    image processor sized for small images (28-pixel cells: 14-pixel patches merged 2 x 2), as (tokenizer, image
    processor). Not a Qwen2_5_VLProcessor: building one needs its video processor, which needs torchvision (not a
    dependency); both parts are saved where AutoTokenizer and AutoImageProcessor find them."""
    from transformers import Qwen2VLImageProcessor

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = QWEN2_VL_TEMPLATE
    images = Qwen2VLImageProcessor(size={"shortest_edge": 28 * 28 * 2, "longest_edge": 28 * 28 * 24},
                                   patch_size=14, temporal_patch_size=2, merge_size=2)
    return tokenizer, images


def tiny_config(tokenizer):
    from transformers import Qwen2_5_VLConfig
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           [("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")]}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2)
    # window 56 px = 2 merged cells: a 4 x 6 cell image spans several windows; block 1 attends over the whole image
    vision = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, window_size=56, fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


@functools.cache
def tiny_qwen2_5_vl_dir() -> str:
    """A directory with a random-weight Qwen2.5-VL (2 text layers, 2 vision blocks) and its processor."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    tokenizer, images = tiny_processor()

    from lmport.models.loader import cache_root
    # Not model_helpers.saved_model: that one saves the default model's tokenizer over the processor's.
    target = cache_root() / "test-models" / "tiny-qwen2_5_vl-v1"
    if not (target / "config.json").exists():
        torch.manual_seed(1234)
        model = Qwen2_5_VLForConditionalGeneration(tiny_config(tokenizer)).to(torch.float32)
        model.generation_config.eos_token_id = 2
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        images.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """An image of random colours (seeded) encoded as ``fmt``."""
    from PIL import Image
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format=fmt)
    return out.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    import base64
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"
