"""Images in, text out for Mistral 3 (Mistral Small 3.1's architecture: a Pixtral tower, the projector's patch merger,
a Mistral decoder): a tiny random-weight model against transformers' own.

The reference is transformers: ``PixtralProcessor`` (its image processor's resize and its prompt expansion into rows
of ``[IMG]`` ended by ``[IMG_BREAK]`` and ``[IMG_END]``) and ``Mistral3ForConditionalGeneration.generate`` on the same
checkpoint, greedy in float32 on cpu; the same through ``/v1/chat/completions`` with the official ``openai`` client
and a data: URL."""
from __future__ import annotations

import base64
import dataclasses
import functools

import anthropic
import openai
import pytest
import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.engine import Engine
from lmport.engine.llm import LLM
from lmport.engine.outputs import RequestError
from lmport.multimodal.loading import image_processor
from lmport.server.app import create_app
from support.vision_helpers import (CASES, MISTRAL3_MERGE, MISTRAL3_PATCH, check_prefix_cache_keys_include_the_images,
                                    data_url, generate_greedy, greedy_reference, lmport_prompt, pixtral_processor_class,
                                    png, processor_inputs, tiny_mistral3_dir)
from test_server import ServerThread

NEW_TOKENS = 10
ONE_IMAGE = "one image, text before and after"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_mistral3_dir()


@functools.cache
def processors(model_dir):
    """transformers' PixtralProcessor and lmport's image processor of the model."""
    return pixtral_processor_class().from_pretrained(model_dir), image_processor(model_dir)


def reference_inputs(model_dir, parts) -> dict:
    """transformers' inputs for a conversation: PixtralProcessor's expanded prompt, pixel values and image sizes."""
    return processor_inputs(processors(model_dir)[0], parts)


@pytest.fixture(scope="module")
def reference(hf, model_dir):
    """transformers' greedy tokens for a conversation's parts, generated once a module."""
    return functools.cache(lambda parts: reference_tokens(hf, reference_inputs(model_dir, parts)))


def reference_tokens(hf, inputs) -> list[int]:
    return greedy_reference(hf, inputs, NEW_TOKENS, ("pixel_values", "image_sizes"))




def check_greedy(case, llm, reference, model_dir):
    parts = CASES[case]
    inputs = reference_inputs(model_dir, parts)
    ids, images = lmport_prompt(llm, model_dir, parts)
    assert ids == inputs["input_ids"][0].tolist()   # the processor's rows of [IMG], breaks and ends, token for token
    if "pixel_values" in inputs:   # the same resized pixels (transformers pads the batch to the largest image)
        assert [list(im.pixel_values.shape[1:]) for im in images] == inputs["image_sizes"].tolist()
        assert all(torch.equal(torch.from_numpy(im.pixel_values), pixels[:, :h, :w])
                   for im, pixels, (h, w) in zip(images, inputs["pixel_values"], inputs["image_sizes"].tolist()))
    assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)


def test_greedy_tokens_equal_transformers_generate_one_image(llm, reference, model_dir):
    check_greedy(ONE_IMAGE, llm, reference, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c for c in CASES if c != ONE_IMAGE])
def test_greedy_tokens_equal_transformers_generate(case, llm, reference, model_dir):
    check_greedy(case, llm, reference, model_dir)


def test_an_image_is_one_input_spanning_its_rows_breaks_and_end(llm, model_dir):
    """90 x 60 pixels, resized to fit 64 (64 x 42) and up to whole 16-pixel cells: 3 rows of 4 [IMG] tokens, each
    row ended by [IMG_BREAK], the last by [IMG_END]; the image's 12 encoder rows go to the [IMG] tokens only."""
    ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    tokenizer = llm.tokenizer
    img, brk, end = (tokenizer.convert_tokens_to_ids(t) for t in ("[IMG]", "[IMG_BREAK]", "[IMG_END]"))
    [image] = images
    assert (image.num_tokens, image.span, image.grid_thw) == (12, 15, (1, 3 * MISTRAL3_MERGE, 4 * MISTRAL3_MERGE))
    assert ids[image.offset:image.end] == ([img] * 4 + [brk]) * 2 + [img] * 4 + [end]
    assert image.pixel_values is not None and image.pixel_values.shape == (3, 3 * MISTRAL3_MERGE * MISTRAL3_PATCH,
                                                                           4 * MISTRAL3_MERGE * MISTRAL3_PATCH)


def test_an_image_whose_span_does_not_hold_its_rows_is_refused(llm, model_dir):
    ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    short = dataclasses.replace(images[0], span=images[0].num_tokens - 1)
    with pytest.raises(RequestError, match="must start with the image placeholder token .* and hold 12 of them"):
        llm.add_request(ids, GenerationConfig(max_new_tokens=1), images=[short])


def test_a_text_model_lmport_does_not_run_is_refused_by_name():
    """Ministral 3's text model (``ministral3``) scales its attention by position: refused before any weight loads."""
    from transformers import Mistral3Config

    from lmport.models.architectures import lmport_config
    config = Mistral3Config(text_config={"model_type": "ministral3"})
    with pytest.raises(ValueError, match="'ministral3' text model is not supported; lmport runs Mistral 3 with a "
                                         "'mistral' or 'llama' text model"):
        lmport_config(config)


@pytest.mark.slow
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


@pytest.mark.slow
def test_chunked_prefill_splits_an_image_and_still_equals_transformers(model_dir, reference):
    """Chunks of 6 tokens cut the images' spans (rows and breaks): each chunk's [IMG] tokens take their rows of the
    whole image's encoding, kept in the encoder cache, or (a cache that keeps nothing) encoded again at each chunk,
    then each image in a vision tower call of its own."""
    parts = CASES["two images of two sizes"]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                      max_prefill_token_num=6, max_batch_size=2))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert all(image.offset // 6 != (image.end - 1) // 6 for image in images)   # each image split across chunks
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
        llm.model.encoded.entries.clear()
        llm.model.encoded.held = llm.model.encoded.rows = 0
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
        llm.model.encode_patches = 1
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
    finally:
        llm.close()


@pytest.mark.slow
def test_prefix_cache_keys_include_the_images(llm, model_dir):
    """Same text, another image: no prefix-cache hit; the same image again: a hit."""
    check_prefix_cache_keys_include_the_images(llm, model_dir)


@pytest.fixture(scope="module")
def server(model_dir):
    app = create_app(Engine(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=128)),
                     model_name="tiny-mistral3")
    server = ServerThread(app)
    yield server
    server.stop()


def reference_reply(model_dir, reference, parts) -> tuple[int, str]:
    """transformers' prompt length and greedy text for a conversation's parts."""
    text = processors(model_dir)[0].tokenizer.decode(reference(parts), skip_special_tokens=True)
    return reference_inputs(model_dir, parts)["input_ids"].shape[1], text


def test_chat_completions_with_a_data_url_equals_transformers(server, model_dir, reference):
    parts = CASES[ONE_IMAGE]
    prompt_tokens, text = reference_reply(model_dir, reference, parts)
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
    reply = client.chat.completions.create(model="tiny-mistral3", messages=[{"role": "user", "content": content}],
                                           temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.prompt_tokens == prompt_tokens
    assert reply.choices[0].message.content == text


@pytest.mark.slow
def test_anthropic_image_blocks_equal_transformers(server, model_dir, reference):
    """Two images of two sizes (a PNG and a JPEG) as base64 ``image`` blocks among text blocks."""
    parts = CASES["two images of two sizes"]
    prompt_tokens, text = reference_reply(model_dir, reference, parts)
    media = {b"\x89PNG": "image/png", b"\xff\xd8\xff": "image/jpeg"}
    content = [{"type": "text", "text": p} if isinstance(p, str) else
               {"type": "image", "source": {"type": "base64", "data": base64.b64encode(p).decode(),
                                            "media_type": next(m for head, m in media.items() if p.startswith(head))}}
               for p in parts]
    client = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = client.messages.create(model="tiny-mistral3", max_tokens=NEW_TOKENS, messages=[
        {"role": "user", "content": content}], extra_body={"temperature": 0, "ignore_eos": True})
    assert message.usage.input_tokens == prompt_tokens
    assert "".join(b.text for b in message.content if b.type == "text") == text


@pytest.mark.slow
def test_preempted_sequences_recompute_their_images(model_dir, reference):
    """Two image prompts of three blocks each in a cache of seven: both are admitted, both need a fourth block as
    they generate, so one is preempted, its blocks freed, and recomputed from its tokens and images when readmitted;
    both still give transformers' tokens."""
    prompts = [("Look at this picture, please, and then tell me what you see in it, briefly:", png(64, 64, 1)),
               ("See this one here,", png(64, 56, 6), "and then tell me what it shows in a few short words:")]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", block_size=16, cache_max_entry_count=7))
    try:
        requests = [lmport_prompt(llm, model_dir, parts) for parts in prompts]
        # three blocks each, a fourth before the last token (whose K/V is never written)
        assert all(32 < len(ids) <= 48 < len(ids) + NEW_TOKENS - 1 for ids, _ in requests)
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
