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


# SmolVLM's chat template (an image part becomes <image>, which the processor expands into its tiles' tokens).
SMOLVLM_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}{% if message['content'] is string %}"
    "{{ ': ' + message['content'] }}{% else %}{% if message['content'][0]['type'] == 'image' %}{{ ':' }}{% else %}"
    "{{ ': ' }}{% endif %}{% for line in message['content'] %}{% if line['type'] == 'text' %}{{ line['text'] }}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}<end_of_utterance>\n"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}")

# Tiles of 32 x 32 pixels, 8-pixel patches: 16 patches, 4 tokens a tile after the 2 x 2 pixel shuffle.
IDEFICS3_TILE, IDEFICS3_PATCH, IDEFICS3_SCALE = 32, 8, 2
IDEFICS3_IMAGE_SEQ_LEN = (IDEFICS3_TILE // IDEFICS3_PATCH) ** 2 // IDEFICS3_SCALE ** 2


def tiny_idefics3_processor():
    """transformers' Idefics3Processor over the default model's tokenizer (with SmolVLM's image tokens and chat
    template added) and Idefics3's image processor (its PIL one: the default needs torchvision), sized for small
    images: each image resized to at most 96 pixels a side and cut into 32-pixel tiles plus a global image."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2")
    tags = ["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", *tags]})
    images = Idefics3ImageProcessorPil(size={"longest_edge": 3 * IDEFICS3_TILE},
                                       max_image_size={"longest_edge": IDEFICS3_TILE})
    return Idefics3Processor(images, tokenizer, image_seq_len=IDEFICS3_IMAGE_SEQ_LEN, chat_template=SMOLVLM_TEMPLATE)


@functools.cache
def tiny_idefics3_dir() -> str:
    """A directory with a random-weight Idefics3 (SmolVLM's architecture: a 2-layer SigLIP tower, the pixel-shuffle
    connector, a 2-layer Llama) and its processor."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / "tiny-idefics3-v1"
    if not (target / "config.json").exists():
        processor = tiny_idefics3_processor()
        tokenizer = processor.tokenizer
        text = dict(model_type="llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                    rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=IDEFICS3_TILE, patch_size=IDEFICS3_PATCH)
        config = Idefics3Config(text_config=text, vision_config=vision, scale_factor=IDEFICS3_SCALE,
                                image_token_id=tokenizer.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
        torch.manual_seed(1234)
        model = Idefics3ForConditionalGeneration(config).to(torch.float32)
        model.generation_config.eos_token_id = 2
        tmp = target.with_name(target.name + f".tmp{os.getpid()}")
        model.save_pretrained(tmp)
        processor.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def conversation(*parts) -> list[dict]:
    """A user message of text and images (bytes) in order."""
    return [{"role": "user", "content": [{"type": "text", "text": p} if isinstance(p, str) else {"type": "image"}
                                         for p in parts]}]


def reference_model(model_dir: str):
    """transformers' vision-language model of ``model_dir`` in float32: the reference."""
    from transformers import AutoModelForImageTextToText
    return AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()


def vision_engine(model_dir: str):
    """lmport's engine of ``model_dir`` on the cpu in float32, with prefix caching."""
    from lmport import EngineConfig
    from lmport.engine.llm import LLM
    return LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=128,
                                       enable_prefix_caching=True))


# Prompts of text and images (PNG or JPEG bytes) the vision tests run, in order.
CASES = {
    "one image, text before and after": ("Look at this:", png(90, 60, 1), "What is it?"),
    "two images of two sizes": ("First", png(60, 120, 2), "then", png(150, 90, 3, "JPEG"), "compare them."),
    "text only": ("Say something about colours.",),
}


def generate_greedy(llm, ids: list[int], images, max_new_tokens: int):
    """The finished output of one greedy request (``images``: its image inputs, or none) stepped alone."""
    from lmport import GenerationConfig
    gen = GenerationConfig(max_new_tokens=max_new_tokens, temperature=0.0, ignore_eos=True)
    request_id = llm.add_request(ids, gen, images=images or None)
    final = None
    while llm.has_unfinished():
        for out in llm.step():
            if out.request_id == request_id and out.finished:
                final = out
    assert final is not None and final.error is None, final
    return final
