"""Images in, text out for Qwen3-VL: a tiny random-weight model against transformers' own.

The reference is transformers: ``Qwen3VLForConditionalGeneration`` on the same checkpoint (its ``generate``, greedy,
and its forward's logits), float32 on cpu, with the pixel values of the checkpoint's image processor and a prompt
whose placeholders the test expands as ``Qwen3VLProcessor`` does (one ``<|image_pad|>`` a merged patch); its
``Qwen3VLModel.get_rope_index`` for the M-RoPE positions; the same through ``/v1/chat/completions`` with the
official ``openai`` client. What Qwen3-VL adds over Qwen2.5-VL (Qwen3's decoder, interleaved M-RoPE, deepstack
features added after the first decoder layers) is covered by the parity; the logits test shows that leaving the
deepstack out would break it."""
from __future__ import annotations

import functools
import io
import itertools

import pytest
import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.llm import LLM
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.mrope import mrope_positions
from support.vision_helpers import (CASES, conversation, generate_greedy, greedy_reference, lmport_prompt, png,
                                    served_answers, tiny_qwen3_vl_dir)

NEW_TOKENS = 10
ONE_IMAGE = "one image, text before and after"
TWO_IMAGES = "two images of two sizes"


@pytest.fixture(scope="module")
def model_dir():
    return tiny_qwen3_vl_dir()


@functools.cache
def tokenizer_of(model_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(model_dir)


def reference_inputs(model_dir, parts) -> dict:
    """transformers' inputs for a conversation: the image processor's pixel values and grids, the template's prompt
    with each placeholder repeated once a merged patch (Qwen3VLProcessor's expansion) and its mm_token_type_ids."""
    from PIL import Image
    from transformers import AutoImageProcessor
    tokenizer = tokenizer_of(model_dir)
    text = tokenizer.apply_chat_template(conversation(*parts), tokenize=False, add_generation_prompt=True)
    images = [Image.open(io.BytesIO(p)).convert("RGB") for p in parts if isinstance(p, bytes)]
    out = {}
    if images:
        processor = AutoImageProcessor.from_pretrained(model_dir)
        out = dict(processor(images=images, return_tensors="pt"))
        pieces = text.split("<|image_pad|>")
        counts = [int(g.prod()) // processor.merge_size ** 2 for g in out["image_grid_thw"]]
        text = pieces[0] + "".join("<|image_pad|>" * n + piece for n, piece in zip(counts, pieces[1:]))
    ids = torch.tensor([tokenizer.encode(text, add_special_tokens=False)])
    out["input_ids"] = ids
    if images:
        out["mm_token_type_ids"] = (ids == tokenizer.convert_tokens_to_ids("<|image_pad|>")).int()
    return out


@pytest.fixture(scope="module")
def reference(hf, model_dir):
    """transformers' greedy tokens for a conversation's parts, generated once a module."""
    return functools.cache(lambda parts: reference_tokens(hf, reference_inputs(model_dir, parts)))


def reference_tokens(hf, inputs) -> list[int]:
    return greedy_reference(hf, inputs, NEW_TOKENS, ("pixel_values", "image_grid_thw", "mm_token_type_ids"))




def check_greedy(case, llm, reference, model_dir):
    parts = CASES[case]
    inputs = reference_inputs(model_dir, parts)
    ids, images = lmport_prompt(llm, model_dir, parts)
    assert ids == inputs["input_ids"][0].tolist()   # the placeholders expanded to transformers' count
    if images:   # the same patches, image after image
        assert torch.equal(torch.cat([torch.from_numpy(im.pixel_values) for im in images]), inputs["pixel_values"])
    assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)


def test_greedy_tokens_with_one_image_equal_transformers_generate(llm, reference, model_dir):
    check_greedy(ONE_IMAGE, llm, reference, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("case", [case for case in CASES if case != ONE_IMAGE])
def test_greedy_tokens_equal_transformers_generate(case, llm, reference, model_dir):
    check_greedy(case, llm, reference, model_dir)


def test_openai_and_anthropic_clients_get_transformers_answer_for_two_images(model_dir, reference):
    """The official openai and anthropic clients each get transformers' prompt length and greedy text."""
    parts = CASES[TWO_IMAGES]
    text = tokenizer_of(model_dir).decode(reference(parts), skip_special_tokens=True)
    want = (reference_inputs(model_dir, parts)["input_ids"].shape[1], text)
    assert served_answers(model_dir, "tiny-qwen3-vl", parts, NEW_TOKENS) == [want, want]


# (text before, [(grid, text after)]): grids as the image processor gives them (merged 2 x 2)
LAYOUTS = [
    (3, [((1, 4, 6), 5)]),
    (2, [((1, 2, 10), 3), ((1, 6, 6), 1)]),
    (4, [((1, 10, 4), 1), ((1, 2, 2), 2), ((1, 4, 4), 7)]),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_mrope_positions_equal_transformers_get_rope_index(layout, hf):
    """Qwen3-VL interleaves the axes over the frequencies (its rotary module, adopted) but places tokens by the
    same rule as Qwen2.5-VL: lmport.multimodal.mrope against Qwen3VLModel.get_rope_index, whole and in chunks."""
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
    for start, end in itertools.pairwise(sorted({0, 5, len(ids) // 2, len(ids)})):
        assert torch.equal(mrope_positions(inputs, start, end, 2), expected[:, 0, start:end])
    n = len(ids)
    assert torch.equal(mrope_positions(inputs, n, n + 3, 2), (torch.arange(n, n + 3) + delta[0]).expand(3, -1))


@pytest.mark.slow
def test_first_token_logprobs_equal_transformers_and_need_the_deepstack(llm, hf, model_dir):
    """lmport's log-probabilities of the first generated token equal transformers' forward's; transformers without
    its deepstack features (no vision block feeding the decoder's first layers) gives others, by more than the
    tolerance: a model that left them out would fail this test and, over ten tokens, most likely the greedy ones."""
    parts = CASES[TWO_IMAGES]
    ids, images = lmport_prompt(llm, model_dir, parts)
    out = llm.add_request(ids, GenerationConfig(max_new_tokens=1, temperature=0.0, logprobs=5), images=images)
    final = None
    while llm.has_unfinished():
        final = next((o for o in llm.step() if o.request_id == out and o.finished), final)
    assert final is not None
    ours = final.logprobs[0]
    inputs = reference_inputs(model_dir, parts)

    def last_logprobs():
        with torch.no_grad():
            return torch.log_softmax(hf(**inputs).logits[0, -1].float(), -1)

    theirs = last_logprobs()
    indexes = hf.model.visual.deepstack_visual_indexes
    hf.model.visual.deepstack_visual_indexes = []
    try:
        without = last_logprobs()
    finally:
        hf.model.visual.deepstack_visual_indexes = indexes
    tokens = torch.tensor(list(ours))
    gap = (torch.tensor(list(ours.values())) - theirs[tokens]).abs().max().item()
    assert gap < 1e-4
    assert (theirs - without).abs().max().item() > 100 * max(gap, 1e-5)


@pytest.mark.slow
def test_chunked_prefill_splits_an_image_and_still_equals_transformers(model_dir, reference):
    """Chunks of 8 tokens cut a 15-token image: each chunk's rows (merged output and deepstack sets) are the whole
    image's, encoded once and kept, or (the encoder cache emptied) encoded again at each chunk."""
    parts = ("Picture:", png(150, 100, 4), "Describe.")
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                      max_prefill_token_num=8, max_batch_size=2))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert images[0].num_tokens > 8 and images[0].offset // 8 != (images[0].end - 1) // 8
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
        llm.model.encoded.entries.clear()
        llm.model.encoded.held = llm.model.encoded.rows = 0   # keeps nothing: each chunk encodes the image again
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
    finally:
        llm.close()


@pytest.mark.slow
def test_a_batch_of_image_prompts_equals_transformers_each(llm, reference, model_dir):
    """Three prompts (two with images, one without) prefilled in one step: each image's rows and deepstack rows land
    on its own sequence's tokens."""
    prompts = [CASES[ONE_IMAGE], CASES[TWO_IMAGES], CASES["text only"]]
    gen = GenerationConfig(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [lmport_prompt(llm, model_dir, parts) for parts in prompts]
    ids = [llm.add_request(prompt, gen, images=images or None) for prompt, images in requests]
    done = {}
    while llm.has_unfinished():
        done |= {out.request_id: out.token_ids for out in llm.step() if out.finished}
    assert [done[i] for i in ids] == [reference(parts) for parts in prompts]


@pytest.mark.slow
def test_prefix_cache_keys_include_the_images(llm, model_dir):
    """Same text, another image: no prefix-cache hit; the same image again: a hit, and the same tokens."""
    one = lmport_prompt(llm, model_dir, ("A long enough question about this picture, please:", png(150, 100, 11)))
    other = lmport_prompt(llm, model_dir, ("A long enough question about this picture, please:", png(150, 100, 12)))
    assert one[0] == other[0] and len(one[0]) > 2 * llm.config.block_size
    first = generate_greedy(llm, *one, 2)
    assert first.cached_tokens == 0
    assert generate_greedy(llm, *other, 2).cached_tokens == 0
    again = generate_greedy(llm, *one, 2)
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids


@pytest.mark.slow
def test_preempted_sequences_recompute_their_images(model_dir, reference):
    """Two image prompts of two blocks each in a cache of five: one is preempted as they grow, and recomputed from
    its tokens and images (deepstack rows included) when readmitted; both still give transformers' tokens."""
    prompts = [("Look at it:", png(150, 100, 1)), ("See", png(100, 150, 6))]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", block_size=16, cache_max_entry_count=5))
    try:
        requests = [lmport_prompt(llm, model_dir, parts) for parts in prompts]
        assert all(16 < len(ids) <= 32 < len(ids) + NEW_TOKENS for ids, _ in requests)
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
