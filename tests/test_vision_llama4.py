"""Images in, text out for Llama 4 (``Llama4ForConditionalGeneration``: the Llama 4 vision model of tiles and its
pixel-shuffle adapter, the projector, Llama 4's text decoder with chunked attention, NoPE layers and experts): a tiny
random-weight model against transformers' own.

The references are transformers: ``Llama4Processor``'s prompt expansion (tiles of ``<|patch|>`` with their
separators, ``<|image|>`` and the global view), ``Llama4ImageProcessor``'s pixels (run where torchvision's Python
code can be imported: it is not a dependency), and ``Llama4ForConditionalGeneration.generate`` on the same checkpoint,
greedy in float32 on cpu; and the same through `lmport serve` with the official ``openai`` client."""
from __future__ import annotations

import dataclasses
import functools
import io

import numpy as np
import pytest
import torch
from PIL import Image

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.llm import LLM
from lmport.engine.outputs import RequestError
from support.vision_helpers import (LLAMA4_TILE, LLAMA4_TILE_TOKENS, check_prefix_cache_keys_include_the_images,
                                    client_answers, generate_greedy, llama4_reference_processor,
                                    llama4_transformers_pixels, lmport_image_processor, lmport_prompt, png,
                                    processor_inputs, reference_model, tiny_llama4_dir,
                                    tiny_llama4_llama_cpp_dir, vision_engine)

NEW_TOKENS = 10
ONE_IMAGE = "one image of 2 x 2 tiles, text before and after"
CASES = {
    ONE_IMAGE: ("Look at this:", png(90, 60, 1), "What is it?"),
    # one tile (no global view), then 2 x 2 tiles and the global view
    "two images of two sizes": ("First", png(24, 20, 2), "then", png(150, 90, 3, "JPEG"), "compare them."),
    "text only": ("Say something about colours.",),
}


@pytest.fixture(scope="module")
def model_dir():
    return tiny_llama4_dir()


def lmport_tiles(model_dir, image) -> tuple[np.ndarray, tuple[int, int]]:
    tiles, rows, cols = lmport_image_processor(model_dir).tiles(image)
    return np.stack(tiles), (rows, cols)


@functools.cache
def reference_processor(model_dir):
    """transformers' Llama4Processor, its image processor giving lmport's tiles (checked against transformers' in
    test_tiles_equal_transformers_image_processor)."""
    return llama4_reference_processor(model_dir, functools.partial(lmport_tiles, model_dir))


def transformers_greedy(hf, inputs: dict) -> list[int]:
    """transformers' greedy tokens: ``Llama4ForConditionalGeneration.forward``'s own steps (its vision model and
    projector, the rows scattered onto the image token's places), then its language model's ``generate``. The
    forward itself fails in transformers 5.24 as it assembles its output (``image_outputs`` of the language model's
    output, which has none), after computing exactly this."""
    ids = inputs["input_ids"]
    with torch.inference_mode():
        embeds = hf.get_input_embeddings()(ids)
        if "pixel_values" in inputs:
            features = hf.get_image_features(pixel_values=inputs["pixel_values"], return_dict=True).last_hidden_state
            rows = hf.multi_modal_projector(features.view(-1, features.size(-1)))
            embeds = embeds.masked_scatter(hf.get_placeholder_mask(ids, inputs_embeds=embeds, image_features=rows),
                                           rows)
        out = hf.language_model.generate(inputs_embeds=embeds, attention_mask=torch.ones_like(ids),
                                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, -NEW_TOKENS:].tolist()


@pytest.fixture(scope="module")
def reference(hf, model_dir):
    """transformers' greedy tokens for a conversation's parts, generated once a module."""
    return functools.cache(lambda parts: transformers_greedy(hf, processor_inputs(reference_processor(model_dir),
                                                                                  parts)))


def check_greedy(case, llm, reference, model_dir):
    parts = CASES[case]
    inputs = processor_inputs(reference_processor(model_dir), parts)
    ids, images = lmport_prompt(llm, model_dir, parts)
    assert ids == inputs["input_ids"][0].tolist()   # Llama4Processor's layout, token for token
    if "pixel_values" in inputs:   # each tile on its own run of <|patch|>, in the processor's order
        assert torch.equal(torch.from_numpy(np.stack([im.pixel_values for im in images])), inputs["pixel_values"])
    assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)


def test_greedy_tokens_equal_transformers_generate_one_image(llm, reference, model_dir):
    check_greedy(ONE_IMAGE, llm, reference, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != ONE_IMAGE])
def test_greedy_tokens_equal_transformers_generate(case, llm, reference, model_dir):
    check_greedy(case, llm, reference, model_dir)


@pytest.mark.slow   # another checkpoint, its engine and transformers' model
def test_the_checkpoint_shaped_for_llama_cpp_equals_transformers_generate():
    """The checkpoint tests/test_vision_gguf.py converts for llama.cpp (3 vision blocks, 4 text layers with the
    chunk, NoPE interval and temperature floor llama.cpp assumes, up to 16 tiles an image): lmport on its directory
    gives transformers' greedy tokens for each case, so its GGUF pair's reference is transformers' too."""
    model_dir = tiny_llama4_llama_cpp_dir()
    hf, llm = reference_model(model_dir), vision_engine(model_dir)
    try:
        processor = llama4_reference_processor(model_dir, functools.partial(lmport_tiles, model_dir))
        for case in CASES:
            check_greedy(case, llm, lambda parts: transformers_greedy(hf, processor_inputs(processor, parts)),
                         model_dir)
    finally:
        llm.close()


@pytest.mark.slow   # transformers' image processor in a subprocess (its imports)
def test_tiles_equal_transformers_image_processor(model_dir):
    """transformers' Llama4ImageProcessor (canvas choice, aspect-preserving resize, padding, tiles, the global view,
    bfloat16 normalization): the same tiles, bit for bit, for images that fit one tile, 2 x 2 tiles, and a row and a
    column of four."""
    images = [png(90, 60, 1), png(24, 20, 2), png(150, 90, 3, "JPEG"), png(300, 17, 4), png(5, 200, 5)]
    want = llama4_transformers_pixels(model_dir, images)
    if want is None:
        pytest.skip("transformers' Llama4ImageProcessor needs torchvision: pip install --no-deps --target "
                    "~/.cache/lmport-torchvision torchvision (or set LMPORT_TORCHVISION_DIR)")
    shapes = []
    for data, (pixels, ratio) in zip(images, want, strict=True):
        tiles, shape = lmport_tiles(model_dir, Image.open(io.BytesIO(data)))
        assert shape == ratio
        np.testing.assert_array_equal(tiles, pixels)
        shapes.append(shape)
    assert shapes == [(2, 2), (1, 1), (2, 2), (1, 4), (4, 1)]


def test_each_tile_is_one_input_on_its_run_of_patch_tokens(llm, model_dir):
    """90 x 60 pixels fit a canvas of 2 x 2 tiles of 32: <|image_start|>, each row of tiles' 16 <|patch|> runs split by
    <|tile_x_separator|> and ended by <|tile_y_separator|>, <|image|>, the global view's 16, <|image_end|>; each of
    the five runs is one input with its own tile."""
    ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    t = {name: llm.tokenizer.convert_tokens_to_ids(f"<|{name}|>") for name in
         ("image_start", "image_end", "image", "patch", "tile_x_separator", "tile_y_separator")}
    patches = [t["patch"]] * LLAMA4_TILE_TOKENS
    row = patches + [t["tile_x_separator"]] + patches + [t["tile_y_separator"]]
    layout = [t["image_start"]] + row + row + [t["image"]] + patches + [t["image_end"]]
    start = images[0].offset - 1
    assert ids[start:start + len(layout)] == layout
    assert [im.offset - start for im in images] == [1, 18, 35, 52, 70]
    assert all(im.num_tokens == LLAMA4_TILE_TOKENS and im.pixel_values is not None
               and im.pixel_values.shape == (3, LLAMA4_TILE, LLAMA4_TILE) for im in images)
    assert len({im.digest for im in images}) == 5


def test_a_tile_off_its_patch_tokens_is_refused(llm, model_dir):
    ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    moved = [dataclasses.replace(images[0], offset=images[0].offset - 1), *images[1:]]
    with pytest.raises(RequestError, match="are not all the image placeholder token"):
        llm.add_request(ids, GenerationConfig(max_new_tokens=1), images=moved)


def test_tensor_parallelism_is_refused_before_any_weight_loads(model_dir):
    from lmport.errors import ConfigError
    from lmport.models.loader import read_model_config
    from lmport.parallel import check_tp
    with pytest.raises(ConfigError, match="experts are not split over ranks"):
        check_tp(read_model_config(str(model_dir)), 2)


@pytest.mark.parametrize("settings, problem", [
    ({"resample": 3}, "resample=3 is not supported"),
    ({"do_resize": False}, "do_resize=False is not supported"),
    ({"size": {"height": 32, "width": 64}}, "takes square tiles"),
    ({"do_rescale": False}, "do_normalize and not do_rescale is not supported"),
])
def test_image_processor_settings_lmport_does_not_run_are_refused(settings, problem):
    from lmport.multimodal.llama4 import TOKEN_DEFAULTS, Llama4ImageProcessor
    with pytest.raises(ValueError, match=problem):
        Llama4ImageProcessor(settings, {key: i for i, key in enumerate(TOKEN_DEFAULTS)}, 4, 0.5)


@pytest.mark.slow
def test_the_image_changes_the_answer(llm, model_dir):
    """The parity above is not won by ignoring the image: another image with the same text gives other logits."""
    gen = GenerationConfig(max_new_tokens=1, temperature=0.0, logprobs=5)
    first = []
    for seed in (1, 7):
        ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, seed)))
        request_id = llm.add_request(ids, gen, images=images)
        while llm.has_unfinished():
            first += [out.logprobs for out in llm.step() if out.request_id == request_id and out.finished]
    assert first[0] != first[1]


@pytest.mark.slow
def test_chunked_prefill_splits_tiles_and_still_equals_transformers(model_dir, reference):
    """Chunks of 6 tokens cut every tile's run of 16: each chunk's patch tokens take their rows of the tile's
    encoding, kept in the encoder cache, or (a cache that keeps nothing) encoded again at each chunk; the chunked
    attention's chunks of 32 end inside steps too."""
    parts = CASES["two images of two sizes"]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                      max_prefill_token_num=6, max_batch_size=2))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert all(image.offset // 6 != (image.end - 1) // 6 for image in images)   # each tile split across chunks
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
        llm.model.encoded.entries.clear()
        llm.model.encoded.held = llm.model.encoded.rows = 0
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
    finally:
        llm.close()


@pytest.mark.slow
def test_prefix_cache_keys_include_the_images(llm, model_dir):
    """Same text, another image: no prefix-cache hit; the same image again: a hit."""
    check_prefix_cache_keys_include_the_images(llm, model_dir)


@pytest.mark.slow   # a server process: its imports and the model's load
def test_lmport_serve_answers_openai_and_anthropic_clients_as_transformers(model_dir, reference, tmp_path):
    """`lmport serve DIR`: the official openai and anthropic clients' chats with two images get transformers'
    prompt length and greedy answer."""
    from support.cli_helpers import lmport_command
    from support.serve_process import ServeProcess
    parts = CASES["two images of two sizes"]
    processor = reference_processor(model_dir)
    want = (processor_inputs(processor, parts)["input_ids"].shape[1],
            processor.tokenizer.decode(reference(parts), skip_special_tokens=True))
    flags = ["--device", "cpu", "--dtype", "float32", "--cache-max-entry-count", "64"]
    server = ServeProcess(lmport_command(), [model_dir, *flags], tmp_path / "serve.log").ready()
    try:
        assert client_answers(server.url, model_dir, parts, NEW_TOKENS) == [want, want]
    finally:
        server.stop()
