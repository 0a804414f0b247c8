"""Images in, text out for Gemma 3 (``Gemma3ForConditionalGeneration``): a tiny random-weight model against
transformers' own.

The reference is transformers: ``Gemma3Processor`` (its image processor's pixels and its prompt expansion, the
whole text tokenized) and ``Gemma3ForConditionalGeneration.generate`` on the same checkpoint with the processor's
``token_type_ids`` (which make an image's tokens attend to each other both ways), greedy in float32 on cpu; the same
through ``/v1/chat/completions`` with the official ``openai`` client and a data: URL. The tiny model's sliding window
(6) is narrower than an image (16 tokens), so the window's rule and the image's both shape the mask."""
from __future__ import annotations

import functools

import pytest
import torch

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.llm import LLM
from lmport.multimodal.chunks import whole_image_chunk
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.loading import image_processor
from support.vision_helpers import (CASES, GEMMA3_IMAGE_TOKENS, generate_greedy, greedy_reference, lmport_prompt, png,
                                    processor_inputs, served_answers, tiny_gemma3_dir)

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model_dir():
    return tiny_gemma3_dir()


@functools.cache
def processors(model_dir):
    """transformers' Gemma3Processor and lmport's image processor of the model."""
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(model_dir), image_processor(model_dir)


def reference_inputs(model_dir, parts) -> dict:
    """transformers' inputs for a conversation: Gemma3Processor's expanded prompt, pixels and token types."""
    return processor_inputs(processors(model_dir)[0], parts)


@pytest.fixture(scope="module")
def reference(hf, model_dir):
    """transformers' greedy tokens for a conversation's parts, generated once a module."""
    return functools.cache(lambda parts: reference_tokens(hf, reference_inputs(model_dir, parts)))


def reference_tokens(hf, inputs) -> list[int]:
    return greedy_reference(hf, inputs, NEW_TOKENS, ("pixel_values", "token_type_ids"))




@pytest.mark.parametrize("case", CASES)
def test_greedy_tokens_equal_transformers_generate(case, llm, reference, model_dir):
    parts = CASES[case]
    inputs = reference_inputs(model_dir, parts)
    ids, images = lmport_prompt(llm, model_dir, parts)
    assert ids == inputs["input_ids"][0].tolist()   # the processor's expansion, its newlines tokenized alike
    if "pixel_values" in inputs:
        assert len(images) == len(inputs["pixel_values"])
        for pixels, image in zip(inputs["pixel_values"], images):
            assert torch.equal(pixels, torch.from_numpy(image.pixel_values))
        # each image on the run of tokens transformers marks as the image's (token type 1)
        marked = [i for i, t in enumerate(inputs["token_type_ids"][0].tolist()) if t == 1]
        assert marked == [i for image in images for i in range(image.offset, image.end)]
    assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)


def first_logprobs(llm, ids, images) -> dict[int, float]:
    gen = GenerationConfig(max_new_tokens=1, temperature=0.0, logprobs=5)
    request_id = llm.add_request(ids, gen, images=images)
    final = None
    while llm.has_unfinished():
        final = next((out for out in llm.step() if out.request_id == request_id and out.finished), final)
    assert final is not None and final.error is None
    return final.logprobs[0]


def test_an_image_attends_to_itself_both_ways_as_transformers_does(llm, hf, model_dir):
    """The parity above needs the bidirectional mask: transformers' first-token log-probabilities without the token
    types (causal only) differ from those with them, and lmport's are the latter's."""
    parts = CASES["one image, text before and after"]
    inputs = reference_inputs(model_dir, parts)
    with torch.no_grad():
        both = hf(**inputs).logits[0, -1].log_softmax(-1)
        causal = hf(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0, -1].log_softmax(-1)
    assert (both - causal).abs().max() > 1e-2
    got = first_logprobs(llm, *lmport_prompt(llm, model_dir, parts))
    tokens = list(got)
    torch.testing.assert_close(torch.tensor([got[t] for t in tokens]), both[tokens], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_keeps_each_image_whole(model_dir, reference):
    """Chunks of 20 tokens would cut the first image (16 tokens each) of the two-image prompt: each chunk ends before an
    image it would end inside, the image computed whole in the next one (the model refuses a step that ends inside
    an image); the tokens are transformers'."""
    parts = CASES["two images of two sizes"]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                      max_prefill_token_num=20, max_batch_size=2))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert any(image.offset // 20 != (image.end - 1) // 20 for image in images)   # fixed chunks would split one
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
    finally:
        llm.close()


def test_a_chunk_ends_before_an_image_or_takes_it_whole():
    images = [ImageInput(10, 16, (1, 8, 8), "a"), ImageInput(30, 16, (1, 8, 8), "b")]
    assert whole_image_chunk(images, 0, 8, 8, 64) == 8          # ends before the first image
    assert whole_image_chunk(images, 0, 20, 20, 64) == 10       # would end inside it: ends at its start
    assert whole_image_chunk(images, 10, 8, 40, 64) == 16       # starts at it: the whole image where room allows
    assert whole_image_chunk(images, 10, 8, 12, 64) == 0        # ... else waits for a step with room
    assert whole_image_chunk(images, 14, 4, 40, 64) == 12       # starts inside it (a cached prefix): the rest
    assert whole_image_chunk(images, 26, 10, 10, 64) == 4       # ends inside the second: at its start
    assert whole_image_chunk(images, 10, 8, 8, 8) == 8          # larger than any step: the model refuses it


def test_the_scheduler_never_ends_a_chunk_inside_an_image():
    """Scheduler.whole_images, no model: five short prompts and two with images (one at the prompt's start) in steps
    of 20 tokens. The first chunk of ``b`` would end inside its image: it ends at the image's start; then, with five
    sequences decoding, the 16-token image does not fit in the 15 tokens left and waits for a step with room; ``c``,
    admitted behind them, starts at its image and waits too. Every prompt is computed, no chunk ends inside an
    image."""
    from lmport.kv.block_manager import BlockManager
    from lmport.sched.output import ModelOutput, SequenceOutput
    from lmport.sched.scheduler import Scheduler
    from lmport.sched.sequence import Sequence

    scheduler = Scheduler(BlockManager(num_blocks=64, block_size=4), max_batch_size=8, max_prefill_token_num=20)
    scheduler.whole_images = True
    gen = GenerationConfig(max_new_tokens=3, ignore_eos=True)
    short = [Sequence(f"d{i}", [5, 6], gen) for i in range(5)]
    b = Sequence("b", list(range(10, 34)), gen, images=[ImageInput(4, 16, (1, 8, 8), "b")])
    c = Sequence("c", list(range(10, 30)), gen, images=[ImageInput(0, 16, (1, 8, 8), "c")])
    for seq in [*short, b, c]:
        scheduler.add(seq)
    chunks: list[dict[str, tuple[int, int]]] = []
    running: list[set[str]] = []
    while scheduler.has_unfinished():
        batch = scheduler.schedule()
        running.append({s.request_id for s in scheduler.running})
        chunks.append({s.request_id: (s.num_computed, s.num_computed + n) for s, n in zip(batch.seqs, batch.num_new)})
        done = {s: SequenceOutput([7] if s.num_computed + n >= s.num_tokens else [], [None])
                for s, n in zip(batch.seqs, batch.num_new)}
        scheduler.update_from_output(batch, ModelOutput(done))
        assert len(chunks) < 50
    assert chunks[0]["b"] == (0, 4)                                 # b ends before its image
    assert "c" in running[0] and "c" not in chunks[0]               # c, admitted at its image, waits for room
    waited = [step for step in chunks if "d0" in step and "b" not in step and b.num_computed]
    assert waited, chunks                                           # b's image waited while the others decoded
    for step in chunks:
        for name, (start, end) in step.items():
            seq = next(s for s in [*short, b, c] if s.request_id == name)
            assert not any(im.offset < end < im.end for im in seq.images), (name, start, end)
    assert b.is_finished and c.is_finished


def test_openai_and_anthropic_clients_get_transformers_answer(model_dir, reference):
    """The official openai and anthropic clients each get transformers' prompt length and greedy text."""
    parts = CASES["one image, text before and after"]
    text = processors(model_dir)[0].tokenizer.decode(reference(parts), skip_special_tokens=True)
    want = (reference_inputs(model_dir, parts)["input_ids"].shape[1], text)
    assert served_answers(model_dir, "tiny-gemma3", parts, NEW_TOKENS) == [want, want]


@pytest.mark.slow
@pytest.mark.parametrize("text", ["A question about this picture, please:", "See:"])
def test_prefix_cache_keys_include_the_images(llm, model_dir, reference, text):
    """Same text, another image: no prefix-cache hit; the same image again: a hit, transformers' tokens. With the
    short text the hit ends inside the image: the rest of its tokens attend to the cached ones, which were computed
    with the whole image."""
    one = lmport_prompt(llm, model_dir, (text, png(90, 60, 11)))
    other = lmport_prompt(llm, model_dir, (text, png(90, 60, 12)))
    assert one[0] == other[0] and len(one[0]) > llm.config.block_size
    first = generate_greedy(llm, *one, max_new_tokens=NEW_TOKENS)
    assert first.cached_tokens == 0 and first.token_ids == reference((text, png(90, 60, 11)))
    assert generate_greedy(llm, *other, max_new_tokens=2).cached_tokens == 0
    again = generate_greedy(llm, *one, max_new_tokens=NEW_TOKENS)
    assert again.cached_tokens > 0 and again.token_ids == first.token_ids
    image = one[1][0]
    assert (image.offset < again.cached_tokens < image.end) == (text == "See:")


@pytest.mark.slow
def test_preempted_sequences_recompute_their_images(model_dir, reference):
    """Two image prompts of three blocks each in a cache of seven: both are admitted, both need a fourth block as
    they generate, so one is preempted and recomputed from its tokens and image when readmitted; both still give
    transformers' tokens."""
    prompts = [("Look at this picture, please, and tell me:", png(96, 20, 1)),
               ("See this one here, and then say what it shows", png(20, 96, 6))]
    llm = LLM(model_dir, EngineConfig(device_type="cpu", dtype="float32", block_size=16, cache_max_entry_count=7))
    try:
        requests = [lmport_prompt(llm, model_dir, parts) for parts in prompts]
        assert all(32 < len(ids) <= 48 < len(ids) + NEW_TOKENS for ids, _ in requests), [len(i) for i, _ in requests]
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


def test_each_image_is_one_run_of_soft_tokens(llm, model_dir):
    ids, images = lmport_prompt(llm, model_dir, ("Look:", png(90, 60, 1), "and", png(40, 40, 2)))
    tokenizer = llm.tokenizer
    for image in images:
        assert image.num_tokens == GEMMA3_IMAGE_TOKENS
        assert ids[image.offset - 1] == tokenizer.boi_token_id and ids[image.end] == tokenizer.eoi_token_id


@pytest.mark.slow
def test_the_cuda_backend_runs_the_image_spans_and_equals_transformers(reference, model_dir):
    """The cuda backend (its Triton kernels under the interpreter, on CPU tensors, as tests/conformance runs it):
    image steps go to the reference paged attention with the spans, the other steps to its kernels."""
    pytest.importorskip("triton")
    from lmport.backends.cuda import CudaBackend
    parts = CASES["one image, text before and after"]
    llm = LLM(model_dir, EngineConfig(device_type="cuda", dtype="float32", cache_max_entry_count=128),
              backend=CudaBackend(device="cpu"))
    try:
        ids, images = lmport_prompt(llm, model_dir, parts)
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == reference(parts)
    finally:
        llm.close()
