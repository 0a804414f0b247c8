"""A tiny random-weight Qwen2.5-VL for tests, saved with its processor (tokenizer, image processor, chat template),
and small images to send it."""
from __future__ import annotations

import functools
import io

import pytest
import torch

from support.saved_dirs import save_once


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
        save_once(target, model, tokenizer, images)
    return str(target)


# Qwen3-VL's own chat template (no default system message; an image part becomes
# <|vision_start|><|image_pad|><|vision_end|>), without its tool, video and reasoning branches.
QWEN3_VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for content in message['content'] %}{% if content['type'] == 'image' or "
    "'image' in content or 'image_url' in content %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Qwen3-VL's patches are 16 pixels (merged 2 x 2: 32-pixel cells) and normalized to [-1, 1].
QWEN3_VL_PATCH = 16


def tiny_qwen3_vl_processor():
    """The default model's tokenizer with the vision tokens and Qwen3-VL's chat template added, and Qwen3-VL's
    image processor settings on Qwen2VLImageProcessor (what its preprocessor_config.json names, less the fast one's
    torchvision) sized for small images, as (tokenizer, image processor)."""
    from transformers import Qwen2VLImageProcessor

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2")
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tokenizer.chat_template = QWEN3_VL_TEMPLATE
    cell = QWEN3_VL_PATCH * 2
    images = Qwen2VLImageProcessor(size={"shortest_edge": cell * cell * 2, "longest_edge": cell * cell * 24},
                                   patch_size=QWEN3_VL_PATCH, temporal_patch_size=2, merge_size=2,
                                   image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    return tokenizer, images


def tiny_qwen3_vl_config(tokenizer):
    """3 text layers (Qwen3's: q/k norm, head_dim apart from the width), M-RoPE interleaved over 8 frequencies;
    3 vision blocks, the first and last giving deepstack features (added after text layers 0 and 1)."""
    from transformers import Qwen3VLConfig
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in
           [("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
            ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>")]}
    text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2],
                                 "mrope_interleaved": True})
    vision = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                  patch_size=QWEN3_VL_PATCH, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64,
                  deepstack_visual_indexes=[0, 2])
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False, **ids)


@functools.cache
def tiny_qwen3_vl_dir() -> str:
    """A directory with a random-weight Qwen3-VL (3 text layers, 3 vision blocks, 2 deepstack sets) and its
    processor's parts (tokenizer and image processor: a Qwen3VLProcessor needs its video processor, which needs
    torchvision)."""
    from transformers import Qwen3VLForConditionalGeneration

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / "tiny-qwen3_vl-v1"
    if not (target / "config.json").exists():
        tokenizer, images = tiny_qwen3_vl_processor()
        torch.manual_seed(1234)
        model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer)).to(torch.float32)
        model.generation_config.eos_token_id = 2
        save_once(target, model, tokenizer, images)
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


def media_type(image: bytes) -> str:
    return "image/jpeg" if image.startswith(b"\xff\xd8") else "image/png"


def check_prefix_cache_keys_include_the_images(
        llm, model_dir: str, text: str = "A question about this picture, please: which colours and shapes do you see "
                                          "in it?", size: tuple[int, int] = (64, 64)) -> None:
    """Same text with another image: no prefix-cache hit; the same image again: a hit, with the same tokens."""
    one = lmport_prompt(llm, model_dir, (text, png(*size, 11)))
    other = lmport_prompt(llm, model_dir, (text, png(*size, 12)))
    assert one[0] == other[0] and len(one[0]) > 2 * llm.config.block_size
    first = generate_greedy(llm, *one, max_new_tokens=2)
    assert first.cached_tokens == 0
    assert generate_greedy(llm, *other, max_new_tokens=2).cached_tokens == 0
    again = generate_greedy(llm, *one, max_new_tokens=2)
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids


def served_answers(model_dir: str, name: str, parts, new_tokens: int) -> list[tuple[int, str]]:
    """``client_answers`` from a server thread over an engine of ``model_dir`` serving it as ``name``."""
    from lmport import EngineConfig
    from lmport.engine.engine import Engine
    from lmport.server.app import create_app
    from test_server import ServerThread
    app = create_app(Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=128)),
                     model_name=name)
    server = ServerThread(app)
    try:
        return client_answers(server.url, name, parts, new_tokens)
    finally:
        server.stop()


def client_answers(url: str, name: str, parts, new_tokens: int) -> list[tuple[int, str]]:
    """(prompt tokens, text) of a greedy answer to a user message of ``parts`` (text and images) from the server at
    ``url``: through the official ``openai`` client (images as data: URLs), then the official ``anthropic`` client
    (base64 ``image`` blocks)."""
    import base64

    import anthropic
    import openai
    chat = [{"type": "text", "text": p} if isinstance(p, str) else
            {"type": "image_url", "image_url": {"url": data_url(p, media_type(p))}} for p in parts]
    reply = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0).chat.completions.create(
        model=name, messages=[{"role": "user", "content": chat}], temperature=0, max_tokens=new_tokens,
        extra_body={"ignore_eos": True})
    assert reply.usage is not None
    blocks = [{"type": "text", "text": p} if isinstance(p, str) else
              {"type": "image", "source": {"type": "base64", "media_type": media_type(p),
                                           "data": base64.b64encode(p).decode()}} for p in parts]
    message = anthropic.Anthropic(base_url=url, api_key="none", max_retries=0).messages.create(
        model=name, max_tokens=new_tokens, messages=[{"role": "user", "content": blocks}],
        extra_body={"temperature": 0, "ignore_eos": True})
    # Anthropic's input_tokens leave out what the prefix cache read (the openai call's prompt, where caching is on)
    prompt = message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0)
    return [(reply.usage.prompt_tokens, reply.choices[0].message.content or ""),
            (prompt, "".join(b.text for b in message.content if b.type == "text"))]


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
        save_once(target, model, processor)
    return str(target)


# Mistral Small 3.1's chat template, its system prompt and tool branches left out (an image part becomes [IMG],
# which the processor expands into its rows of [IMG] tokens).
MISTRAL3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}[INST]{% if message['content'] is string %}"
    "{{ message['content'] }}{% else %}{% for block in message['content'] %}{% if block['type'] == 'text' %}"
    "{{ block['text'] }}{% elif block['type'] in ('image', 'image_url') %}[IMG]{% endif %}{% endfor %}{% endif %}"
    "[/INST]{% elif message['role'] == 'assistant' %}{{ message['content'] }}{{ eos_token }}{% endif %}{% endfor %}")

# 8-pixel patches merged 2 x 2: one [IMG] token a 16-pixel cell; images resized to at most 64 pixels a side.
MISTRAL3_PATCH, MISTRAL3_MERGE, MISTRAL3_LONGEST_EDGE = 8, 2, 64


def pixtral_processor_class():
    """transformers' PixtralProcessor (its prompt expansion is the reference). Its module imports the torchvision
    image processor, and torchvision is not a dependency: the PIL image processor's module (same resize rule) stands
    in for it while the module is imported."""
    import importlib
    import sys

    from transformers.models.pixtral import image_processing_pil_pixtral
    name = "transformers.models.pixtral.image_processing_pixtral"
    saved = sys.modules.get(name)
    sys.modules[name] = image_processing_pil_pixtral
    try:
        return importlib.import_module("transformers.models.pixtral.processing_pixtral").PixtralProcessor
    finally:
        if saved is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = saved


def tiny_mistral3_processor():
    """transformers' PixtralProcessor over the default model's tokenizer (with Pixtral's image tokens, [INST] and
    [/INST] and Mistral Small 3.1's chat template added) and Pixtral's image processor (its PIL one: the default
    needs torchvision), sized for small images."""
    from transformers import PixtralImageProcessorPil

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2")
    tokenizer.add_special_tokens({"additional_special_tokens": ["[IMG]", "[IMG_BREAK]", "[IMG_END]", "[INST]",
                                                                "[/INST]"]})
    images = PixtralImageProcessorPil(size={"longest_edge": MISTRAL3_LONGEST_EDGE},
                                      patch_size={"height": MISTRAL3_PATCH, "width": MISTRAL3_PATCH})
    return pixtral_processor_class()(images, tokenizer, patch_size=MISTRAL3_PATCH, spatial_merge_size=MISTRAL3_MERGE,
                                     chat_template=MISTRAL3_TEMPLATE)


@functools.cache
def tiny_mistral3_dir() -> str:
    """A directory with a random-weight Mistral 3 (Mistral Small 3.1's architecture: a 2-layer Pixtral tower, the
    projector with its 2 x 2 patch merger, a 2-layer Mistral with its head_dim apart from the width) and its
    processor, saved as the checkpoints are (processor_config.json, preprocessor_config.json, the tokenizer)."""
    return _tiny_mistral3("tiny-mistral3-v1", vision_layers=2, seed=1234)


def _tiny_mistral3(name: str, vision_layers: int, seed: int) -> str:
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / name
    if not (target / "config.json").exists():
        processor = tiny_mistral3_processor()
        tokenizer = processor.tokenizer
        text = dict(model_type="mistral", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=None,
                    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, bos_token_id=1, eos_token_id=2)
        vision = dict(model_type="pixtral", hidden_size=32, intermediate_size=64, num_hidden_layers=vision_layers,
                      num_attention_heads=2, image_size=MISTRAL3_LONGEST_EDGE, patch_size=MISTRAL3_PATCH)
        config = Mistral3Config(text_config=text, vision_config=vision, spatial_merge_size=MISTRAL3_MERGE,
                                image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"), tie_word_embeddings=False)
        torch.manual_seed(seed)
        model = Mistral3ForConditionalGeneration(config).to(torch.float32)
        model.generation_config.eos_token_id = 2
        save_once(target, model, processor, processor.image_processor)
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


# Every test session's (tests/conftest.py): a vision family's test module defines its ``model_dir`` fixture, and these
# two serve that model.
@pytest.fixture(scope="module")
def hf(model_dir):
    """transformers' model of the module's ``model_dir``: the reference."""
    return reference_model(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir):
    """lmport's engine of the module's ``model_dir``, closed after the module."""
    engine = vision_engine(model_dir)
    yield engine
    engine.close()


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


@functools.cache
def lmport_image_processor(model_dir: str):
    """lmport's image processor of a test model's directory (lmport.multimodal.loading), loaded once."""
    from lmport.multimodal.loading import image_processor
    processor = image_processor(model_dir)
    assert processor is not None, f"{model_dir} takes no images"
    return processor


def lmport_prompt(llm, model_dir: str, parts) -> tuple[list, list]:
    """lmport's prompt ids and image inputs for a conversation's parts: the chat template's text, tokenized, then
    expanded by lmport's image processor."""
    from lmport.multimodal.images import ImageLimits
    text = llm.tokenizer.apply_chat_template(conversation(*parts), tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    return lmport_image_processor(model_dir).prepare(ids, [p for p in parts if isinstance(p, bytes)], ImageLimits())


def processor_inputs(processor, parts) -> dict:
    """transformers' inputs for a conversation's parts, made by the model's own transformers processor (its chat
    template, its prompt expansion and its image processor's pixels)."""
    from PIL import Image
    text = processor.apply_chat_template(conversation(*parts), tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
    return dict(processor(text=text, images=images or None, add_special_tokens=False, return_tensors="pt"))


def greedy_reference(hf, inputs: dict, new_tokens: int, image_keys: tuple[str, ...]) -> list[int]:
    """transformers' ``new_tokens`` greedy tokens after ``inputs["input_ids"]``, given those of ``image_keys`` the
    inputs hold."""
    ids = inputs["input_ids"]
    extra = {k: inputs[k] for k in image_keys if k in inputs}
    out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                      min_new_tokens=new_tokens, do_sample=False, **extra)
    return out[0, ids.shape[1]:].tolist()


# What llama.cpp assumes of a Qwen2.5-VL, whose mmproj file does not store it: an attention window of 112 pixels
# (clip.cpp), images of 8 to 4096 tokens of 28 x 28 pixels (clip.cpp's set_limit_image_tokens).
LLAMA_CPP_QWEN2_VL_WINDOW, LLAMA_CPP_QWEN2_VL_TOKENS = 112, (8, 4096)


@functools.cache
def tiny_qwen2_5_vl_llama_cpp_dir() -> str:
    """A directory with a random-weight Qwen2.5-VL that llama.cpp's converter and mtmd run as transformers does: the
    window and image sizes llama.cpp assumes (above), 4 vision blocks with full attention every 2nd (the converter
    maps the merger's layers by block index, so it needs 3 blocks or more; llama.cpp stores the pattern)."""
    from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2VLImageProcessor

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / "tiny-qwen2_5_vl-llama-cpp-v1"
    if not (target / "config.json").exists():
        tokenizer, _ = tiny_processor()
        low, high = LLAMA_CPP_QWEN2_VL_TOKENS
        images = Qwen2VLImageProcessor(size={"shortest_edge": 28 * 28 * low, "longest_edge": 28 * 28 * high},
                                       patch_size=14, temporal_patch_size=2, merge_size=2)
        config = tiny_config(tokenizer)
        config.vision_config.window_size = LLAMA_CPP_QWEN2_VL_WINDOW
        config.vision_config.depth, config.vision_config.fullatt_block_indexes = 4, [1, 3]
        torch.manual_seed(2525)
        model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
        model.generation_config.eos_token_id = 2
        save_once(target, model, tokenizer, images)
    return str(target)


@functools.cache
def tiny_idefics3_text_dir() -> str:
    """The tiny Idefics3's Llama decoder alone, as a LlamaForCausalLM directory with the processor's tokenizer and
    chat template: what llama.cpp's converter takes for SmolVLM's text model (it converts an Idefics3 directory's
    vision tower only, ``--mmproj``)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor, LlamaForCausalLM

    from lmport.models.loader import cache_root
    source = tiny_idefics3_dir()
    target = cache_root() / "test-models" / "tiny-idefics3-text-v1"
    if not (target / "config.json").exists():
        full = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32)
        text = LlamaForCausalLM(full.config.text_config).to(torch.float32)
        state = {f"model.{k}": v for k, v in full.model.text_model.state_dict().items()}
        text.load_state_dict(state | {"lm_head.weight": full.lm_head.weight}, strict=True)
        text.generation_config.eos_token_id = 2
        tokenizer = AutoProcessor.from_pretrained(source).tokenizer
        tokenizer.chat_template = SMOLVLM_TEMPLATE
        save_once(target, text, tokenizer)
    return str(target)


# Gemma 3's chat template (its system-prompt branch left out; an image part becomes <start_of_image>, which the
# processor expands into the image's soft tokens between <start_of_image> and <end_of_image>, with newlines around).
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] | trim }}{% else %}{% for item in message['content'] %}"
    "{% if item['type'] in ('image', 'image_url') %}{{ '<start_of_image>' }}{% elif item['type'] == 'text' %}"
    "{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")

# 32 x 32 pixel images in 4-pixel patches (8 x 8), pooled 2 x 2 into 16 soft tokens an image; the sliding layers'
# window (6) is narrower than an image, so an image token's window cuts into its own image.
GEMMA3_IMAGE_SIZE, GEMMA3_PATCH, GEMMA3_IMAGE_TOKENS, GEMMA3_WINDOW = 32, 4, 16, 6


def tiny_gemma3_processor():
    """transformers' Gemma3Processor over the default model's tokenizer (with Gemma 3's image tokens named as its
    tokenizer names them, <start_of_turn> and <end_of_turn>, and Gemma 3's chat template) and Gemma 3's image
    processor (its PIL one: the default needs torchvision), sized for small images."""
    import tempfile

    from transformers import AutoTokenizer, Gemma3ImageProcessorPil, Gemma3Processor

    from lmport.models.loader import load_tokenizer
    with tempfile.TemporaryDirectory() as tmp:
        load_tokenizer("smollm2").save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(tmp, extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    tokenizer.add_special_tokens({"additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]},
                                 replace_extra_special_tokens=False)
    images = Gemma3ImageProcessorPil(size={"height": GEMMA3_IMAGE_SIZE, "width": GEMMA3_IMAGE_SIZE})
    return Gemma3Processor(images, tokenizer, chat_template=GEMMA3_TEMPLATE, image_seq_length=GEMMA3_IMAGE_TOKENS)


@functools.cache
def tiny_gemma3_dir() -> str:
    """A directory with a random-weight Gemma 3 (a 2-layer SigLIP tower, the pooling projector, a 2-layer Gemma 3
    text model: one sliding layer, one global) and its processor. The projection and the norms, which transformers
    initializes to zeros (an image would then read as zeros), are drawn at random too."""
    return _tiny_gemma3("tiny-gemma3-vision-v1", ["sliding_attention", "full_attention"], seed=1234)


class RenamedTensors:
    """A part for ``save_once`` after the model: renames the saved model.safetensors' tensors by prefix."""

    def __init__(self, renames: dict[str, str]):
        self.renames = renames

    def save_pretrained(self, directory) -> None:
        from pathlib import Path

        from safetensors.torch import load_file, save_file
        path = Path(directory) / "model.safetensors"
        state = load_file(path)
        for old, new in self.renames.items():
            state = {new + k[len(old):] if k.startswith(old) else k: v for k, v in state.items()}
        save_file(state, path, metadata={"format": "pt"})


@functools.cache
def tiny_gemma3_llama_cpp_dir() -> str:
    """A random-weight Gemma 3 that llama.cpp's converter and runtime read as transformers does: 6 text layers in
    the pattern llama.cpp assumes of every Gemma 3 (five sliding, then a global one: the file does not store it),
    query_pre_attn_scalar the head size (llama.cpp's scale), the projection's values whole float16 ones (the
    converter stores it F16 whatever the outtype), and the vision tower's tensors under the released checkpoints'
    names (``vision_tower.vision_model.``: the converter's map; transformers loads both)."""
    return _tiny_gemma3("tiny-gemma3-llama-cpp-v1", ["sliding_attention"] * 5 + ["full_attention"], seed=4321,
                        llama_cpp=True)


def _tiny_gemma3(name: str, layer_types: list[str], seed: int, llama_cpp: bool = False) -> str:
    """The tiny Gemma 3 with these text layers, saved once under ``name`` (``llama_cpp``: shaped for llama.cpp's
    converter, as ``tiny_gemma3_llama_cpp_dir`` says)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / name
    if not (target / "config.json").exists():
        processor = tiny_gemma3_processor()
        tokenizer = processor.tokenizer
        text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                    num_hidden_layers=len(layer_types), num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    query_pre_attn_scalar=16, max_position_embeddings=4096, rms_norm_eps=1e-6,
                    sliding_window=GEMMA3_WINDOW, layer_types=layer_types, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=2, pad_token_id=0)
        vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                      image_size=GEMMA3_IMAGE_SIZE, patch_size=GEMMA3_PATCH, vision_use_head=False)
        config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=GEMMA3_IMAGE_TOKENS,
                              boi_token_index=tokenizer.boi_token_id, eoi_token_index=tokenizer.eoi_token_id,
                              image_token_index=tokenizer.image_token_id)
        torch.manual_seed(seed)
        model = Gemma3ForConditionalGeneration(config).to(torch.float32)
        with torch.no_grad():
            for weight, p in model.named_parameters():
                if weight.endswith("mm_input_projection_weight") or ("norm" in weight and "vision_tower" not in weight):
                    p.normal_(0.0, 0.3)
                if llama_cpp and weight.endswith("mm_input_projection_weight"):
                    p.copy_(p.half().float())
        model.generation_config.eos_token_id = 2
        renamed = [RenamedTensors({"vision_tower.": "vision_tower.vision_model."})] if llama_cpp else []
        save_once(target, model, processor, *renamed)
    return str(target)


@functools.cache
def tiny_mistral3_llama_cpp_dir() -> str:
    """A random-weight Mistral 3 that llama.cpp's converter takes: the tiny one's shape with 3 Pixtral layers (the
    converter maps the projector's ``linear_1`` and ``linear_2`` by block index, so the tower needs 3 blocks or
    more)."""
    return _tiny_mistral3("tiny-mistral3-llama-cpp-v1", vision_layers=3, seed=4321)


# Llama 4's image tokens (Llama4Processor's defaults) and the chat template's header and turn tokens.
LLAMA4_TOKENS = ["<|image_start|>", "<|image_end|>", "<|image|>", "<|patch|>", "<|tile_x_separator|>",
                 "<|tile_y_separator|>", "<|header_start|>", "<|header_end|>", "<|eot|>"]
# 32-pixel tiles of 4-pixel patches (8 x 8), pixel-shuffled 2 x 2 into 16 tokens a tile; at most 4 tiles an image.
LLAMA4_TILE, LLAMA4_PATCH, LLAMA4_MAX_TILES, LLAMA4_TILE_TOKENS = 32, 4, 4, 16


def tiny_llama4_tokenizer():
    """The default model's tokenizer with Llama 4's image and chat tokens and Llama4Processor's own chat template."""
    from transformers.models.llama4.processing_llama4 import chat_template

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer("smollm2")
    tokenizer.add_special_tokens({"additional_special_tokens": LLAMA4_TOKENS})
    tokenizer.chat_template = chat_template
    return tokenizer


class Llama4ProcessorFiles:
    """``preprocessor_config.json`` and ``processor_config.json`` as transformers writes them for a Llama 4
    checkpoint (its image processor needs torchvision, so it is not built here to save them); ``max_tiles``: the
    image processor's ``max_patches``."""

    def __init__(self, max_tiles: int = LLAMA4_MAX_TILES):
        self.max_tiles = max_tiles

    def save_pretrained(self, target) -> None:
        import json
        from pathlib import Path
        target = Path(target)
        target.mkdir(parents=True, exist_ok=True)
        images = {"image_processor_type": "Llama4ImageProcessor", "processor_class": "Llama4Processor",
                  "size": {"height": LLAMA4_TILE, "width": LLAMA4_TILE}, "max_patches": self.max_tiles,
                  "resize_to_max_canvas": False, "resample": 2, "do_resize": True, "do_rescale": True,
                  "rescale_factor": 1 / 255, "do_normalize": True, "image_mean": [0.5, 0.5, 0.5],
                  "image_std": [0.5, 0.5, 0.5], "do_convert_rgb": True}
        processor = {"processor_class": "Llama4Processor", "patch_size": LLAMA4_PATCH, "pixel_shuffle_ratio": 0.5,
                     "fake_image_token": "<|image|>", "image_token": "<|image|>"}
        (target / "preprocessor_config.json").write_text(json.dumps(images, indent=2))
        (target / "processor_config.json").write_text(json.dumps(processor, indent=2))


@functools.cache
def tiny_llama4_dir() -> str:
    """A directory with a random-weight Llama 4 image-text model (a 2-layer vision model of 32-pixel tiles and its
    pixel-shuffle adapter, the projector, a 2-layer Llama 4 text model: a rope layer attending in chunks of 32 with
    L2 q/k norms, a NoPE layer with temperature tuning and 4 experts, top 1, beside a shared expert) and its
    processor's files."""
    return _tiny_llama4("tiny-llama4-vision-v1", text_layers=2, vision_layers=2, max_tiles=LLAMA4_MAX_TILES,
                        text_fields=dict(no_rope_layer_interval=2, attention_chunk_size=32, floor_scale=8))


# llama.cpp's image processor for Llama 4 (the mmproj does not store one), and transformers' Llama4ImageProcessor's
# default: at most 16 tiles an image.
LLAMA4_LLAMA_CPP_MAX_TILES = 16


@functools.cache
def tiny_llama4_llama_cpp_dir() -> str:
    """A random-weight Llama 4 that llama.cpp's converter and runtime read as transformers does: 3 vision layers (the
    converter maps the pixel-shuffle adapter's ``fc1`` and ``fc2`` by block index, so the tower needs 3 blocks or
    more), 4 text layers with what a llama4 GGUF cannot say and llama.cpp assumes of every Llama 4 (chunks of 8192,
    every 4th layer NoPE, the temperature's floor 8192), images of up to 16 tiles (the image processor's default:
    the mmproj stores no limit)."""
    return _tiny_llama4("tiny-llama4-llama-cpp-v1", text_layers=4, vision_layers=3,
                        max_tiles=LLAMA4_LLAMA_CPP_MAX_TILES,
                        text_fields=dict(no_rope_layer_interval=4, attention_chunk_size=8192, floor_scale=8192))


def _tiny_llama4(name: str, text_layers: int, vision_layers: int, max_tiles: int, text_fields: dict) -> str:
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / name
    if not (target / "config.json").exists():
        tokenizer = tiny_llama4_tokenizer()
        token = tokenizer.convert_tokens_to_ids
        text = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
                    num_hidden_layers=text_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    max_position_embeddings=4096, rms_norm_eps=1e-5, num_local_experts=4, num_experts_per_tok=1,
                    interleave_moe_layer_step=2, attn_scale=0.1, use_qk_norm=True, initializer_range=0.2,
                    bos_token_id=tokenizer.bos_token_id, eos_token_id=2, pad_token_id=0, **text_fields)
        vision = dict(hidden_size=32, intermediate_size=128, num_hidden_layers=vision_layers, num_attention_heads=2,
                      image_size=LLAMA4_TILE, patch_size=LLAMA4_PATCH, pixel_shuffle_ratio=0.5,
                      projector_input_dim=32, projector_output_dim=32, vision_output_dim=32,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        config = Llama4Config(text_config=text, vision_config=vision, image_token_index=token("<|patch|>"),
                              boi_token_index=token("<|image_start|>"), eoi_token_index=token("<|image_end|>"),
                              tie_word_embeddings=False)
        torch.manual_seed(1234)
        model = Llama4ForConditionalGeneration(config).to(torch.float32)
        model.generation_config.eos_token_id = 2
        save_once(target, model, tokenizer, Llama4ProcessorFiles(max_tiles))
    return str(target)


def llama4_reference_processor(model_dir: str, pixels_of):
    """transformers' Llama4Processor of ``model_dir`` (its prompt expansion is the reference) over an image
    processor that gives, for each image, ``pixels_of(image)``: its tiles [tiles, 3, tile, tile] and (rows, columns)
    of tiles. transformers' Llama4ImageProcessor needs torchvision, which is not a dependency; its pixels are checked
    on their own (``llama4_transformers_pixels``)."""
    from transformers import AutoTokenizer, BatchFeature, Llama4Processor
    from transformers.image_processing_base import ImageProcessingMixin

    class GivenPixels(ImageProcessingMixin):
        def __call__(self, images, **kwargs):
            made = [pixels_of(image) for image in images]
            return BatchFeature({"pixel_values": torch.cat([torch.as_tensor(p) for p, _ in made]),
                                 "aspect_ratios": torch.tensor([list(shape) for _, shape in made])})

    return Llama4Processor(GivenPixels(), AutoTokenizer.from_pretrained(model_dir), patch_size=LLAMA4_PATCH,
                           pixel_shuffle_ratio=0.5)


# transformers' Llama4ImageProcessor, run where torchvision's Python code can be imported: its compiled operators
# (which the image processor does not use) are not loaded, so a torchvision wheel built for another torch serves.
LLAMA4_PIXELS_SCRIPT = """
import importlib.util, sys, types
import numpy as np
spec = importlib.util.find_spec("torchvision")
stub = types.ModuleType("torchvision")
stub.__path__, stub.__spec__ = list(spec.submodule_search_locations), spec
sys.modules["torchvision"] = stub
from PIL import Image
from transformers import Llama4ImageProcessor
processor = Llama4ImageProcessor.from_pretrained(sys.argv[1])
out = {}
for i, path in enumerate(sys.argv[3:]):
    made = processor(images=[Image.open(path)], return_tensors="pt")
    out[f"pixels{i}"] = made["pixel_values"].float().numpy()
    out[f"ratio{i}"] = made["aspect_ratios"].numpy()
np.savez(sys.argv[2], **out)
"""


def llama4_transformers_pixels(model_dir: str, images: list[bytes]):
    """transformers' Llama4ImageProcessor's tiles and (rows, columns) for each image, in a subprocess importing
    torchvision from ``LMPORT_TORCHVISION_DIR`` (default ~/.cache/lmport-torchvision: ``pip install --no-deps --target
    DIR torchvision``); None where torchvision is not there."""
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import numpy as np
    where = Path(os.environ.get("LMPORT_TORCHVISION_DIR", Path.home() / ".cache" / "lmport-torchvision"))
    if not (where / "torchvision").is_dir():
        return None
    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, data in enumerate(images):
            paths.append(str(Path(tmp) / f"image{i}"))
            Path(paths[-1]).write_bytes(data)
        out = str(Path(tmp) / "out.npz")
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(where), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, "-c", LLAMA4_PIXELS_SCRIPT, model_dir, out, *paths], env=env, check=True,
                       timeout=300)
        made = np.load(out)
        return [(made[f"pixels{i}"], tuple(made[f"ratio{i}"][0])) for i in range(len(images))]


@functools.cache
def tiny_qwen3_vl_llama_cpp_dir() -> str:
    """The tiny Qwen3-VL with the image sizes llama.cpp assumes of one (8 to 4096 tokens, clip.cpp's
    set_limit_image_tokens; the mmproj file does not store them), which its converter and mtmd then run as
    transformers does."""
    from transformers import Qwen2VLImageProcessor, Qwen3VLForConditionalGeneration

    from lmport.models.loader import cache_root
    target = cache_root() / "test-models" / "tiny-qwen3_vl-llama-cpp-v1"
    if not (target / "config.json").exists():
        tokenizer, _ = tiny_qwen3_vl_processor()
        cell = QWEN3_VL_PATCH * 2
        low, high = LLAMA_CPP_QWEN2_VL_TOKENS
        images = Qwen2VLImageProcessor(size={"shortest_edge": cell * cell * low, "longest_edge": cell * cell * high},
                                       patch_size=QWEN3_VL_PATCH, temporal_patch_size=2, merge_size=2,
                                       image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
        torch.manual_seed(4321)
        model = Qwen3VLForConditionalGeneration(tiny_qwen3_vl_config(tokenizer)).to(torch.float32)
        model.generation_config.eos_token_id = 2
        save_once(target, model, tokenizer, images)
    return str(target)
