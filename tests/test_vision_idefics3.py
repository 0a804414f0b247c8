"""Images in, text out for Idefics3 (SmolVLM's architecture): a tiny random-weight model against transformers' own.

The reference is transformers: ``Idefics3Processor`` (its image processor's tiles and its prompt expansion) and
``Idefics3ForConditionalGeneration.generate`` on the same checkpoint, greedy in float32 on cpu; the same through
``/v1/chat/completions`` with the official ``openai`` client and a data: URL."""
from __future__ import annotations

import functools

import pytest
import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.llm import LLM
from lmport.multimodal.loading import image_processor
from support.vision_helpers import (CASES, IDEFICS3_IMAGE_SEQ_LEN, check_prefix_cache_keys_include_the_images,
                                    generate_greedy, greedy_reference, lmport_prompt, png, processor_inputs,
                                    served_answers, tiny_idefics3_dir)

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir():
    return tiny_idefics3_dir()


@functools.cache
def processors(model_dir):
    """transformers' Idefics3Processor and lmport's image processor of the model."""
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_dir), image_processor(model_dir)


def reference_inputs(model_dir, parts) -> dict:
    """transformers' inputs for a conversation: Idefics3Processor's expanded prompt, tiles and pixel mask."""
    return processor_inputs(processors(model_dir)[0], parts)


@pytest.fixture(scope="module")
def reference(hf, model_dir):
    """transformers' greedy tokens for a conversation's parts, generated once a module."""
    return functools.cache(lambda parts: reference_tokens(hf, reference_inputs(model_dir, parts)))


def reference_tokens(hf, inputs) -> list[int]:
    return greedy_reference(hf, inputs, NEW_TOKENS, ("pixel_values", "pixel_attention_mask"))




def generate(llm, ids, images, max_new_tokens=NEW_TOKENS):
    return generate_greedy(llm, ids, images, max_new_tokens)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers_generate(case, llm, reference, model_dir):
    parts = CASES[case]
    inputs = reference_inputs(model_dir, parts)
    ids, images = lmport_prompt(llm, model_dir, parts)
    assert ids == inputs["input_ids"][0].tolist()   # the processor's expansion, tile for tile
    if "pixel_values" in inputs:   # the same tiles, in order (transformers pads the batch with empty ones)
        tiles = [t for t in inputs["pixel_values"].flatten(0, 1) if t.any()]
        assert len(tiles) == len(images) and all(torch.equal(t, torch.from_numpy(im.pixel_values))
                                                 for t, im in zip(tiles, images))
    assert generate(llm, ids, images).token_ids == reference(parts)


def test_each_tile_is_an_image_input_on_its_run_of_image_tokens(llm, model_dir):
    """90 x 60 pixels, resized to 96 x 64 and cut into 32-pixel tiles: 2 rows of 3 and a global image."""
    ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    assert len(images) == 2 * 3 + 1
    image_token = llm.model.config.image_token_id
    for image in images:
        assert image.num_tokens == IDEFICS3_IMAGE_SEQ_LEN
        assert ids[image.offset - 1] != image_token and ids[image.end] != image_token
    assert sum(t == image_token for t in ids) == len(images) * IDEFICS3_IMAGE_SEQ_LEN


def test_the_image_changes_the_answer(llm, model_dir):
    """The parity above is not won by ignoring the image: another image with the same text gives other logits."""
    one = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    other = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 7)))
    assert one[0] == other[0]
    gen = GenerationConfig(max_new_tokens=1, temperature=0.0, logprobs=5)
    first = []
    for ids, images in (one, other):
        request_id = llm.add_request(ids, gen, images=images)
        while llm.has_unfinished():
            first += [out.logprobs for out in llm.step() if out.request_id == request_id and out.finished]
    assert first[0] != first[1]


def test_chunked_prefill_splits_a_tile_and_still_equals_transformers(model_dir, reference):
    """Chunks of 6 tokens cut some of the 4-token tiles: each chunk's rows are the whole tile's, encoded once and
    kept in the encoder cache, or (a cache that keeps nothing) encoded again at each chunk, placed at the chunk's
    positions."""
    parts = CASES["one image, text before and after"]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                      max_prefill_token_num=6, max_batch_size=2))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert any(image.offset // 6 != (image.end - 1) // 6 for image in images)   # a tile split across chunks
        assert generate(llm, ids, images).token_ids == reference(parts)
        llm.model.encoded.entries.clear()
        llm.model.encoded.held = llm.model.encoded.rows = 0
        assert generate(llm, ids, images).token_ids == reference(parts)
    finally:
        llm.close()


def test_prefix_cache_keys_include_the_images(llm, model_dir):
    """Same text, another image: no prefix-cache hit; the same image again: a hit."""
    check_prefix_cache_keys_include_the_images(llm, model_dir, "A question about this picture, please:", (90, 60))


def test_openai_and_anthropic_clients_get_transformers_answer(model_dir, reference):
    """The official openai and anthropic clients each get transformers' prompt length and greedy text."""
    parts = CASES["one image, text before and after"]
    text = processors(model_dir)[0].tokenizer.decode(reference(parts), skip_special_tokens=True)
    want = (reference_inputs(model_dir, parts)["input_ids"].shape[1], text)
    assert served_answers(model_dir, "tiny-smolvlm", parts, NEW_TOKENS) == [want, want]


@pytest.mark.slow
def test_preempted_sequences_recompute_their_tiles(model_dir, reference):
    """Two image prompts of three blocks each in a cache of seven: both are admitted, both need a fourth block as
    they generate, so one is preempted, its blocks freed, and recomputed from its tokens and tiles when readmitted;
    both still give transformers' tokens."""
    prompts = [("Look at this picture, please:", png(96, 20, 1)), ("See this one here, and then", png(20, 96, 6))]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", block_size=16, cache_max_entry_count=7))
    try:
        requests = [lmport_prompt(llm, model_dir, parts) for parts in prompts]
        assert all(32 < len(ids) <= 48 < len(ids) + NEW_TOKENS for ids, _ in requests)
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [llm.add_request(prompt, gen, images=images) for prompt, images in requests]
        done = {}
        while llm.has_unfinished():
            done |= {out.request_id: out.token_ids for out in llm.step() if out.finished}
        assert llm.scheduler.num_preemptions > 0
        for request_id, parts in zip(ids, prompts):
            assert done[request_id] == reference(parts)
    finally:
        llm.close()
