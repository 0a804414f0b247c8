"""Images in, text out through the engine: a tiny random-weight Qwen2.5-VL against transformers' own.

The reference is transformers: ``Qwen2_5_VLForConditionalGeneration.generate`` on the same checkpoint, with the
pixel values of transformers' image processor and a prompt whose placeholders the test expands itself, greedy in
float32 on cpu; and ``Qwen2_5_VLModel.get_rope_index`` for the multimodal rotary positions lmport computes."""
from __future__ import annotations

import io
import itertools

import pytest
import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.llm import LLM
from lmport.engine.outputs import RequestError
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.mrope import mrope_positions
from support.model_helpers import tiny_model_dir
from support.vision_helpers import (CASES, check_prefix_cache_keys_include_the_images, conversation, generate_greedy,
                                    greedy_reference, lmport_prompt, png, tiny_qwen2_5_vl_dir)

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir():
    return tiny_qwen2_5_vl_dir()


def reference_inputs(model_dir, tokenizer, parts) -> dict:
    """transformers' inputs for a conversation: its image processor's pixel values and grids, and the template's
    prompt with each placeholder repeated once per merged patch (what Qwen2_5_VLProcessor writes)."""
    from PIL import Image
    from transformers import AutoImageProcessor
    text = tokenizer.apply_chat_template(conversation(*parts), tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
    out = {}
    if images:
        out = dict(AutoImageProcessor.from_pretrained(model_dir)(images=images, return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // 4 for g in out["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    out["input_ids"] = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    return out


def reference_tokens(hf, inputs) -> list[int]:
    if "pixel_values" in inputs:
        inputs = {**inputs, "mm_token_type_ids": (inputs["input_ids"] == hf.config.image_token_id).int()}
    return greedy_reference(hf, inputs, NEW_TOKENS, ("pixel_values", "image_grid_thw", "mm_token_type_ids"))




def generate(llm, ids, images, max_new_tokens=NEW_TOKENS):
    return generate_greedy(llm, ids, images, max_new_tokens)


@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers_generate(case, llm, hf, model_dir):
    parts = CASES[case]
    reference = reference_inputs(model_dir, llm.tokenizer, parts)
    ids, images = lmport_prompt(llm, model_dir, parts)
    assert ids == reference["input_ids"][0].tolist()   # the placeholders expanded to transformers' count
    assert lmport_tokens(llm, ids, images) == reference_tokens(hf, reference)


def lmport_tokens(llm, ids, images):
    return generate(llm, ids, images or None).token_ids


def test_the_image_changes_the_answer(llm, model_dir):
    """The parity above is not won by ignoring the image: another image with the same text gives other logits."""
    one = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1)))
    other = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 7)))
    assert one[0] == other[0]
    gen = GenerationConfig(max_new_tokens=1, temperature=0.0, logprobs=5)
    first = [generate_with(llm, ids, images, gen).logprobs for ids, images in (one, other)]
    assert first[0] != first[1]


def generate_with(llm, ids, images, gen):
    request_id = llm.add_request(ids, gen, images=images)
    final = None
    while llm.has_unfinished():
        for out in llm.step():
            if out.request_id == request_id and out.finished:
                final = out
    return final


def test_chunked_prefill_splits_an_image_and_still_equals_transformers(model_dir, hf):
    """Chunks of 8 tokens cut a 24-token image in four: each chunk's encoder rows are the whole image's (encoded
    once and kept, or encoded again), placed at the chunk's positions."""
    parts = ("Picture:", png(150, 100, 4), "Describe.")
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                      max_prefill_token_num=8, max_batch_size=2))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert images[0].num_tokens > 8 and images[0].offset % 8 != 0
        reference = reference_tokens(hf, reference_inputs(model_dir, llm.tokenizer, parts))
        assert lmport_tokens(llm, ids, images) == reference
        llm.model.encoded.entries.clear()   # split again, the encoder run at each chunk
        assert lmport_tokens(llm, ids, images) == reference
    finally:
        llm.close()


def test_prefix_cache_keys_include_the_images(llm, model_dir):
    """Same text, another image: no prefix-cache hit (its K/V are other); the same image again: a hit."""
    check_prefix_cache_keys_include_the_images(llm, model_dir, "A long enough question about this picture, please:",
                                               (90, 60))


def test_a_text_model_refuses_images_naming_itself(llm, model_dir):
    ids, images = lmport_prompt(llm, model_dir, ("hi", png(60, 60)))
    text_model = tiny_model_dir("qwen2")
    text_llm = LLM(text_model, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=16))
    try:
        with pytest.raises(RequestError, match=rf"model '{text_model}' takes no images"):
            text_llm.add_request([min(i, 100) for i in ids], GenerationConfig(max_new_tokens=1), images=images)
    finally:
        text_llm.close()


def test_images_must_sit_on_their_placeholders(llm, model_dir):
    ids, images = lmport_prompt(llm, model_dir, ("hi", png(60, 60)))
    with pytest.raises(RequestError, match="placeholder"):
        llm.add_request(ids[:images[0].offset] + [5] + ids[images[0].offset + 1:], GenerationConfig(),
                        images=images)
    with pytest.raises(RequestError, match="no image fills"):
        llm.add_request(ids, GenerationConfig(), images=[])   # placeholders with no image (an empty list: none)


# (text before, [(grid, text after)]): grids as the image processor gives them (2 x 2 merged); a prompt's images
# always have text (<|vision_start|>, <|vision_end|>) on both sides, which transformers' rule needs to tell them apart
LAYOUTS = [
    (3, [((1, 4, 6), 5)]),
    (1, [((1, 8, 2), 1)]),
    (2, [((1, 2, 10), 3), ((1, 6, 6), 1)]),
    (4, [((1, 10, 4), 1), ((1, 2, 2), 2), ((1, 4, 4), 7)]),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mrope_positions_equal_transformers_get_rope_index(layout, hf):
    before, images = layout
    ids, inputs = [7] * before, []
    token = hf.config.image_token_id
    for grid, after in images:
        count = grid[0] * grid[1] * grid[2] // 4
        inputs.append(ImageInput(len(ids), count, grid, f"image{len(inputs)}"))
        ids += [token] * count + [7] * after
    input_ids = torch.tensor([ids])
    expected, delta = hf.model.get_rope_index(input_ids, (input_ids == token).int(),
                                              image_grid_thw=torch.tensor([g for g, _ in images]))
    assert torch.equal(mrope_positions(inputs, 0, len(ids), 2), expected[:, 0])
    cuts = sorted({c for c in (0, 3, 9, len(ids) // 2) if c < len(ids)} | {len(ids)})
    for start, end in itertools.pairwise(cuts):   # the prompt in chunks
        assert torch.equal(mrope_positions(inputs, start, end, 2), expected[:, 0, start:end])
    # generated tokens continue where transformers' rope_deltas put them
    n = len(ids)
    assert torch.equal(mrope_positions(inputs, n, n + 3, 2), (torch.arange(n, n + 3) + delta[0]).expand(3, -1))


def test_a_request_with_images_crosses_to_the_core_as_plain_msgpack(llm, model_dir):
    from lmport.engine.messages import Add, EngineRequest, pack, to_core
    ids, images = lmport_prompt(llm, model_dir, ("two:", png(60, 90, 1), png(120, 60, 2, "JPEG")))
    message = to_core(pack(Add(EngineRequest("r-1", ids, GenerationConfig(), images=images))))
    assert isinstance(message, Add)
    back = message.request.images
    assert back is not None and len(back) == 2
    for image, copy in zip(images, back):
        assert (copy.offset, copy.num_tokens, copy.grid_thw, copy.digest) == \
            (image.offset, image.num_tokens, image.grid_thw, image.digest)
        assert copy.pixel_values is not None and image.pixel_values is not None
        assert (copy.pixel_values == image.pixel_values).all() and copy.pixel_values.dtype == image.pixel_values.dtype


def test_preempted_sequences_recompute_their_images(model_dir, hf):
    """Two image prompts of two blocks each in a cache of five: both are admitted, both need a third block as they
    generate, so one is preempted, its blocks freed, and recomputed from its tokens and images when readmitted;
    both still give transformers' tokens."""
    prompts = [("Look:", png(60, 60, 1)), ("See", png(60, 90, 6))]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", block_size=16, cache_max_entry_count=5))
    try:
        requests = [lmport_prompt(llm, model_dir, parts) for parts in prompts]
        assert all(len(ids) < 32 < len(ids) + NEW_TOKENS for ids, _ in requests)
        gen = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        ids = [llm.add_request(prompt, gen, images=images) for prompt, images in requests]
        done = {}
        while llm.has_unfinished():
            done |= {out.request_id: out.token_ids for out in llm.step() if out.finished}
        assert llm.scheduler.num_preemptions > 0
        for request_id, parts in zip(ids, prompts):
            assert done[request_id] == reference_tokens(hf, reference_inputs(model_dir, llm.tokenizer, parts))
    finally:
        llm.close()
