"""A Qwen2.5-VL from two GGUF files, as llama.cpp serves one: the text model and its mmproj file, both written by
llama.cpp's own ``convert_hf_to_gguf.py`` (``--outtype f32``; ``--mmproj``) from a tiny random-weight checkpoint
(tests/support/vision_helpers.py ``tiny_qwen2_5_vl_llama_cpp_dir``); SmolVLM's pair, the tiny Idefics3's
(``-m slow``: its text GGUF is the Llama decoder saved alone and converted, its mmproj the directory's); and the
pairs of Gemma 3, Mistral 3 (Pixtral), Qwen3-VL and Llama 4, each from a tiny checkpoint shaped as llama.cpp reads
the family (``tiny_*_llama_cpp_dir``; Gemma 3's and Llama 4's one-image cases and Llama 4's modules by default, the
rest ``-m slow``).

References: lmport on the source transformers directory (itself checked against transformers' ``generate`` in
tests/test_vision.py) for greedy tokens and prompt ids; transformers' vision tower and image processor of the
source directory for the tower and the preprocessing lmport builds from the mmproj; llama.cpp's ``llama-server``
on the same two files (``-m slow``). Without the converter (or its ``sentencepiece``) the tests that need it are
skipped, saying so, as tests/test_gguf_llama_cpp.py's are; the refusals run on metadata-only files written here."""
from __future__ import annotations

import base64
import functools
import os
import re
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoModelForImageTextToText

from lmport.config import EngineConfig
from lmport.engine.llm import LLM
from lmport.errors import ConfigError
from lmport.multimodal import mmproj as mmproj_files
from lmport.multimodal.images import ImageLimits
from lmport.multimodal.loading import image_processor, takes_images
from support.vision_helpers import (CASES, conversation, data_url, generate_greedy, png, tiny_gemma3_llama_cpp_dir,
                                    tiny_idefics3_dir, tiny_idefics3_text_dir, tiny_llama4_llama_cpp_dir,
                                    tiny_mistral3_llama_cpp_dir, tiny_qwen2_5_vl_llama_cpp_dir,
                                    tiny_qwen3_vl_llama_cpp_dir)

NEW_TOKENS = 10


# The tiny checkpoints converted for each family (tests/support/vision_helpers.py).
SOURCES = {"qwen2.5-vl": tiny_qwen2_5_vl_llama_cpp_dir, "gemma3": tiny_gemma3_llama_cpp_dir,
           "mistral3": tiny_mistral3_llama_cpp_dir, "qwen3-vl": tiny_qwen3_vl_llama_cpp_dir,
           "llama4": tiny_llama4_llama_cpp_dir}


@functools.cache
def converted_pair(outtype: str = "f32", family: str = "qwen2.5-vl") -> tuple[Path, Path]:
    """(text model, mmproj) of the tiny checkpoint by ``convert_hf_to_gguf.py --outtype OUTTYPE [--mmproj]``, made
    once into lmport's cache. Idefics3's text model is its Llama decoder saved alone (the converter converts an
    Idefics3 directory's vision tower only)."""
    from test_gguf_llama_cpp import _out_dir, _run, _tool
    convert = _tool("convert_hf_to_gguf.py")
    if family == "idefics3":
        sources = (Path(tiny_idefics3_text_dir()), Path(tiny_idefics3_dir()))
    else:
        sources = (Path(SOURCES[family]()),) * 2
    files = []
    for source, kind, flags in zip(sources, ("text", "mmproj"), ([], ["--mmproj"])):
        out = _out_dir() / f"{source.name}-{kind}-{outtype.upper()}.gguf"
        if not out.exists():
            tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")   # pytest workers may race to make it
            _run([sys.executable, convert, source, "--outtype", outtype, "--outfile", tmp, "--model-name",
                  "tiny-random", *flags])
            tmp.replace(out)
        files.append(out)
    return files[0], files[1]


@pytest.fixture(scope="module")
def source_dir() -> str:
    return tiny_qwen2_5_vl_llama_cpp_dir()


@pytest.fixture(scope="module")
def pair() -> tuple[Path, Path]:
    return converted_pair("f32")


def engine(model, mmproj=None) -> LLM:
    return LLM(str(model), EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=128,
                                        mmproj=None if mmproj is None else str(mmproj)))


@pytest.fixture(scope="module")
def source_llm(source_dir):
    llm = engine(source_dir)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def pair_llm(pair):
    llm = engine(*pair)
    yield llm
    llm.close()


def prompt(llm, model, mmproj, parts):
    """The prompt's ids (its placeholders expanded) and images, as the server makes them for ``model``."""
    text = llm.tokenizer.apply_chat_template(conversation(*parts), tokenize=False, add_generation_prompt=True)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    processor = image_processor(str(model), None if mmproj is None else str(mmproj))
    assert processor is not None
    return processor.prepare(ids, [p for p in parts if isinstance(p, bytes)], ImageLimits())


def test_the_vision_config_and_tower_are_the_checkpoints(source_dir, pair):
    """The vision config made of the mmproj's metadata (and llama.cpp's assumptions) is the checkpoint's, and the
    tower holding the file's tensors gives transformers' tower's output on the same pixels."""
    from transformers import AutoConfig, AutoModelForImageTextToText
    text, mmproj = pair
    source = AutoConfig.from_pretrained(source_dir)
    from lmport.models.loader import read_model_config
    made = mmproj_files.checkpoint_config(text, mmproj, read_model_config(str(text)))
    fields = ("depth", "hidden_size", "intermediate_size", "num_heads", "out_hidden_size", "patch_size",
              "spatial_merge_size", "temporal_patch_size", "window_size", "fullatt_block_indexes", "hidden_act")
    assert {f: getattr(made.vision_config, f) for f in fields} == {f: getattr(source.vision_config, f) for f in fields}
    for name in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(made, name) == getattr(source, name), name
    assert made.text_config.rope_parameters["mrope_section"] == source.text_config.rope_parameters["mrope_section"]

    hf = AutoModelForImageTextToText.from_pretrained(source_dir, dtype=torch.float32).eval()
    tower = mmproj_files.vision_tower(mmproj, made.vision_config, torch.float32)
    for (name, ours), (hf_name, theirs) in zip(sorted(tower.state_dict().items()),
                                               sorted(hf.model.visual.state_dict().items()), strict=True):
        assert name == hf_name and torch.equal(ours, theirs), name
    processed = image_processor(str(text), str(mmproj))
    reference = image_processor(source_dir)
    assert processed is not None and reference is not None
    image = _decoded(png(150, 90, 3))   # 5 x 3 merged cells: two windows across
    pixels, grid = processed.process(image)
    want_pixels, want_grid = reference.process(image)
    assert grid == want_grid
    np.testing.assert_allclose(pixels, want_pixels, rtol=0, atol=1e-6)   # mean and std stored as float32
    with torch.inference_mode():
        grid_thw = torch.tensor([want_grid])
        ours = tower(torch.from_numpy(want_pixels), grid_thw=grid_thw).pooler_output
        theirs = hf.model.visual(torch.from_numpy(want_pixels), grid_thw=grid_thw).pooler_output
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def _decoded(data: bytes):
    import io

    from PIL import Image
    return Image.open(io.BytesIO(data)).convert("RGB")


@pytest.mark.parametrize("case", [pytest.param(c, marks=[pytest.mark.slow] if i else []) for i, c in
                                  enumerate(CASES)])
def test_greedy_tokens_equal_the_source_directorys(case, source_dir, pair, source_llm, pair_llm):
    """The GGUF pair's prompt ids (the text GGUF's tokenizer and template, the mmproj's image sizes) and greedy
    tokens equal lmport's on the transformers directory they were converted from."""
    parts = CASES[case]
    want_ids, want_images = prompt(source_llm, source_dir, None, parts)
    ids, images = prompt(pair_llm, *pair, parts)
    assert ids == want_ids
    assert [(i.offset, i.num_tokens, i.grid_thw) for i in images] == [
        (i.offset, i.num_tokens, i.grid_thw) for i in want_images]
    want = generate_greedy(source_llm, want_ids, want_images, NEW_TOKENS).token_ids
    assert generate_greedy(pair_llm, ids, images, NEW_TOKENS).token_ids == want


@pytest.mark.slow
def test_another_image_gives_other_tokens(pair, pair_llm):
    """The image reaches the answer: the same text with another image answers otherwise (so the equalities above
    compare what the tower computes)."""
    answers = set()
    for seed in (1, 2):
        ids, images = prompt(pair_llm, *pair, ("Look at this:", png(112, 84, seed), "What is it?"))
        answers.add(tuple(generate_greedy(pair_llm, ids, images, NEW_TOKENS).token_ids))
    assert len(answers) == 2


@pytest.mark.slow   # llama-quantize and transformers' generate
def test_a_quantized_text_gguf_with_the_mmproj_equals_transformers_on_its_weights(source_dir, pair):
    """The text GGUF through ``llama-quantize`` to Q8_0 (its weights kept quantized, the embedding too) beside the
    F32 mmproj: greedy tokens equal transformers' ``generate`` of the source checkpoint holding the Q8_0 file's
    dequantized text weights (gguf's reference dequantizer), with an image and text before and after."""
    from transformers import AutoModelForImageTextToText, AutoTokenizer

    from support.gguf_files import dequantized_tensors
    from test_gguf_llama_cpp import quantized
    from test_vision import reference_inputs, reference_tokens
    text, mmproj = pair
    q8 = quantized(text, "Q8_0")
    hf = AutoModelForImageTextToText.from_pretrained(source_dir, dtype=torch.float32).eval()
    deq = dequantized_tensors(q8)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2VL, hf.config.text_config.num_hidden_layers)
    with torch.no_grad():
        for name, value in hf.state_dict().items():
            if not name.startswith("model.visual."):
                decoder_name = name.replace("model.language_model.", "model.")
                tensor = names.get_name(decoder_name, try_suffixes=(".weight", ".bias"))
                value.copy_(torch.from_numpy(np.array(deq[tensor])).reshape(value.shape))
    parts = CASES["one image, text before and after"]
    want = reference_tokens(hf, reference_inputs(source_dir, AutoTokenizer.from_pretrained(source_dir), parts))
    llm = engine(q8, mmproj)
    try:
        assert type(llm.core.runner.model.model.embed_tokens).__name__ == "QuantEmbedding"   # kept Q8_0
        ids, images = prompt(llm, q8, mmproj, parts)
        assert generate_greedy(llm, ids, images, NEW_TOKENS).token_ids == want
    finally:
        llm.close()


# -- SmolVLM / Idefics3 ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def idefics3_pair() -> tuple[Path, Path]:
    return converted_pair("f32", "idefics3")


@pytest.mark.slow   # another pair converted
def test_idefics3_vision_modules_and_tiles_are_the_checkpoints(idefics3_pair):
    """SmolVLM's pair (a llama text GGUF, an idefics3 mmproj): the SigLIP tower and connector hold the checkpoint's
    tensors and give its output on the same tile; the tiles and the text that stands for an image are the
    directory's processor's."""
    from transformers import AutoModelForImageTextToText
    text, mmproj = idefics3_pair
    hf = AutoModelForImageTextToText.from_pretrained(tiny_idefics3_dir(), dtype=torch.float32).eval()
    config = mmproj_files.checkpoint_config(text, mmproj)
    vision, connector = mmproj_files.idefics3_modules(mmproj, config, torch.float32)
    for ours, theirs in ((vision, hf.model.vision_model), (connector, hf.model.connector)):
        mine, want = ours.state_dict(), theirs.state_dict()
        assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want)
    processed, reference = image_processor(str(text), str(mmproj)), image_processor(tiny_idefics3_dir())
    assert processed is not None and reference is not None
    image = png(90, 60, 1)
    ids, tiles = processed.prepare([config.image_token_id], [image], ImageLimits())
    want_ids, want_tiles = reference.prepare([config.image_token_id], [image], ImageLimits())
    assert ids == want_ids and len(tiles) == len(want_tiles) > 1
    for tile, want in zip(tiles, want_tiles):
        assert (tile.offset, tile.num_tokens, tile.grid_thw) == (want.offset, want.num_tokens, want.grid_thw)
        np.testing.assert_array_equal(tile.pixel_values, want.pixel_values)
    pixels = torch.from_numpy(np.stack([want_tiles[0].pixel_values]))
    with torch.inference_mode():
        rows = connector(vision(pixel_values=pixels).last_hidden_state)
        want_rows = hf.model.connector(hf.model.vision_model(pixel_values=pixels).last_hidden_state)
    torch.testing.assert_close(rows, want_rows, rtol=0, atol=0)


@pytest.mark.slow   # another pair converted, two engines
def test_idefics3_greedy_tokens_equal_the_source_directorys(idefics3_pair):
    """Prompt ids (tiles' text included) and greedy tokens of SmolVLM's pair equal lmport's on the Idefics3
    directory, for each case."""
    source = engine(tiny_idefics3_dir())
    paired = engine(*idefics3_pair)
    try:
        for parts in CASES.values():
            want_ids, want_images = prompt(source, tiny_idefics3_dir(), None, parts)
            ids, images = prompt(paired, *idefics3_pair, parts)
            assert ids == want_ids
            assert len(images) == len(want_images)
            want = generate_greedy(source, want_ids, want_images, NEW_TOKENS).token_ids
            assert generate_greedy(paired, ids, images, NEW_TOKENS).token_ids == want
    finally:
        source.close()
        paired.close()


# -- Gemma 3, Mistral 3 (Pixtral), Qwen3-VL -------------------------------------------------------------------------

# Where each family's vision modules sit in transformers' model, and the modules lmport builds from the mmproj.
_MODULES = {"gemma3": ("vision_tower", "multi_modal_projector"), "mistral3": ("vision_tower", "multi_modal_projector"),
            "qwen3-vl": ("visual",), "llama4": ("vision_model", "multi_modal_projector")}


def _slow_but(first, *rest):
    return [first, *(pytest.param(r, marks=pytest.mark.slow) for r in rest)]


@pytest.fixture(scope="module")
def family_engines():
    """(source directory's engine, pair's engine) of a family, made once for the module."""
    made: dict[str, tuple[LLM, LLM]] = {}

    def get(family: str) -> tuple[LLM, LLM]:
        if family not in made:
            made[family] = engine(SOURCES[family]()), engine(*converted_pair("f32", family))
        return made[family]
    yield get
    for pair_of in made.values():
        for llm in pair_of:
            llm.close()


def _mmproj_modules(family: str, text: Path, mmproj: Path, config) -> list[torch.nn.Module]:
    if family == "qwen3-vl":
        return [mmproj_files.vision_tower(mmproj, config.vision_config, torch.float32)]
    if family == "llama4":
        return list(mmproj_files.llama4_modules(mmproj, config, torch.float32))
    return list(mmproj_files.tower_and_projector(mmproj, config, torch.float32))


@pytest.mark.parametrize("family", ["llama4", *_slow_but("gemma3", "mistral3", "qwen3-vl")])
def test_the_mmproj_config_and_modules_are_the_checkpoints(family):
    """The config made of the two files' metadata (and llama.cpp's assumptions) is the checkpoint's (vision config,
    image token ids, the tokens an image gives); the vision tower and projector built from the mmproj hold the
    checkpoint's tensors (Gemma 3's soft-embedding norm back from ``1 + w``: equal outputs) and give transformers'
    output on the directory's own pixels."""
    from lmport.models.loader import read_model_config
    text, mmproj = converted_pair("f32", family)
    source = SOURCES[family]()
    hf = AutoModelForImageTextToText.from_pretrained(source, dtype=torch.float32).eval()
    owner = getattr(hf, "model", hf)   # the vision modules' holder (Llama 4's are the model's own)
    made = mmproj_files.checkpoint_config(text, mmproj, read_model_config(str(text)))
    ours_vision = made.vision_config.to_dict()
    want_vision = hf.config.vision_config.to_dict()
    for name in set(ours_vision) | set(want_vision):
        if name not in ("dtype", "layer_norm_eps", "initializer_range"):   # eps: stored as float32
            assert ours_vision.get(name) == want_vision.get(name), name
    for name in ("image_token_id", "boi_token_id", "eoi_token_id", "boi_token_index", "eoi_token_index",
                 "mm_tokens_per_image", "spatial_merge_size",
                 "vision_start_token_id", "vision_end_token_id", "vision_feature_layer"):
        assert getattr(made, name, None) == getattr(hf.config, name, None), name
    modules = _mmproj_modules(family, text, mmproj, made)
    for ours, attribute in zip(modules, _MODULES[family], strict=True):
        mine, want = ours.state_dict(), getattr(owner, attribute).state_dict()
        assert mine.keys() == want.keys()
        for key in want:
            if key != "mm_soft_emb_norm.weight":
                assert torch.equal(mine[key], want[key]), key
    reference = image_processor(source)
    assert reference is not None
    placeholder = reference.placeholder_id if family in ("gemma3", "llama4") else reference.image_token_id
    _, images = reference.prepare([placeholder], [png(90, 60, 1)], ImageLimits())
    pixels = torch.from_numpy(np.stack([images[0].pixel_values]))
    if family == "llama4":   # the image's tiles and its global view: the processor made from the mmproj's the same
        ours_processor = image_processor(str(text), str(mmproj))
        assert ours_processor is not None
        ours_ids, ours_images = ours_processor.prepare([placeholder], [png(90, 60, 1)], ImageLimits())
        want_ids, _ = reference.prepare([placeholder], [png(90, 60, 1)], ImageLimits())
        assert ours_ids == want_ids and len(ours_images) == len(images) > 1
        for mine, want in zip(ours_images, images, strict=True):
            assert np.array_equal(mine.pixel_values, want.pixel_values)
        pixels = torch.from_numpy(np.stack([im.pixel_values for im in images]))
    with torch.inference_mode():
        if family == "qwen3-vl":
            grid = torch.tensor([images[0].grid_thw])
            ours_out = modules[0](pixels[0], grid_thw=grid)
            want_out = hf.model.visual(pixels[0], grid_thw=grid)
            pairs = [(ours_out.pooler_output, want_out.pooler_output),
                     *zip(ours_out.deepstack_features, want_out.deepstack_features, strict=True)]
        elif family == "gemma3":
            pairs = [(modules[1](modules[0](pixel_values=pixels).last_hidden_state),
                      hf.model.multi_modal_projector(hf.model.vision_tower(pixel_values=pixels).last_hidden_state))]
        elif family == "llama4":
            pairs = [(modules[1](modules[0](pixels).last_hidden_state),
                      hf.multi_modal_projector(hf.vision_model(pixels).last_hidden_state))]
        else:
            sizes = torch.tensor([list(pixels.shape[-2:])])
            ours_hidden = modules[0](pixels, image_sizes=sizes).last_hidden_state
            want_hidden = hf.model.vision_tower(pixels, image_sizes=sizes).last_hidden_state
            pairs = [(modules[1](ours_hidden.squeeze(0), sizes), hf.model.multi_modal_projector(want_hidden.squeeze(0),
                                                                                                 sizes))]
    for ours_rows, want_rows in pairs:
        torch.testing.assert_close(ours_rows, want_rows, rtol=0, atol=0)


_DEFAULT_FAMILY_CASES = {("gemma3", "one image, text before and after"), ("llama4", "one image, text before and after")}


@pytest.mark.parametrize("family, case", [
    *sorted(_DEFAULT_FAMILY_CASES),
    *(pytest.param(f, c, marks=pytest.mark.slow) for f in SOURCES if f != "qwen2.5-vl" for c in CASES
      if (f, c) not in _DEFAULT_FAMILY_CASES)])
def test_a_familys_greedy_tokens_equal_the_source_directorys(family, case, family_engines):
    """Prompt ids (the text GGUF's tokenizer and template, the image's tokens as the mmproj sizes them) and greedy
    tokens of the pair equal lmport's on the directory it was converted from (itself checked against transformers'
    ``generate`` in tests/test_vision.py), one image, two of two sizes, text only. Gemma 3's pair runs its image
    spans both ways, as the directory does."""
    source_llm, pair_llm = family_engines(family)
    text, mmproj = converted_pair("f32", family)
    parts = CASES[case]
    want_ids, want_images = prompt(source_llm, SOURCES[family](), None, parts)
    ids, images = prompt(pair_llm, text, mmproj, parts)
    assert ids == want_ids
    assert [(i.offset, i.num_tokens, i.grid_thw, i.span) for i in images] == [
        (i.offset, i.num_tokens, i.grid_thw, i.span) for i in want_images]
    want = generate_greedy(source_llm, want_ids, want_images, NEW_TOKENS).token_ids
    assert generate_greedy(pair_llm, ids, images, NEW_TOKENS).token_ids == want
    if family == "gemma3":   # the pair's model is Gemma 3's with images, its image spans attending both ways
        runner = pair_llm.core.runner
        assert "bidirectional" in type(runner.model).attention_variants(runner.model_config)


# -- refusals -------------------------------------------------------------------------------------------------

def metadata_only_mmproj(path: Path, projector: str = "qwen2.5vl_merger", projection_dim: int = 64,
                         architecture: str = "clip") -> Path:
    """An mmproj file's header as the converter writes a Qwen2.5-VL's (no tensors): what the pair checks read."""
    writer = gguf.GGUFWriter(path, architecture)
    writer.add_type(gguf.GGUFType.MMPROJ)
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_uint32("clip.vision.projection_dim", projection_dim)
    writer.add_string("clip.projector_type", projector)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_a_text_only_model_with_an_mmproj_says_so(tmp_path):
    """A Qwen3 GGUF (no family's vision tower pairs with it) and a Llama one (SmolVLM's text architecture) given
    Qwen2.5-VL's mmproj."""
    from lmport.models.loader import resolve_model_path
    from support.gguf_files import write_gguf
    from support.tiny_hf_models import tiny_model
    model = tiny_model("qwen3")
    text = tmp_path / "qwen3.gguf"
    write_gguf(text, model.config, model.state_dict(), "F32")
    mmproj = metadata_only_mmproj(tmp_path / "mmproj.gguf")
    with pytest.raises(ConfigError, match=re.escape("qwen3.gguf (GGUF architecture 'qwen3') is a text-only model: "
                                                    "mmproj.gguf is a Qwen2.5-VL vision tower, which goes with a "
                                                    "qwen2vl text model")):
        engine(text, mmproj)
    llama = resolve_model_path("smollm2")
    with pytest.raises(ConfigError, match=re.escape(f"{llama.name} (GGUF architecture 'llama') is another family's "
                                                    f"text model")):
        mmproj_files.check_pair(llama, mmproj)


def test_a_directory_with_an_mmproj_says_it_holds_its_own_tower(source_dir, tmp_path):
    with pytest.raises(ConfigError, match="--mmproj goes with a GGUF text model; .* holds its own vision tower"):
        mmproj_files.check_pair(Path(source_dir), metadata_only_mmproj(tmp_path / "mmproj.gguf"))


@pytest.mark.parametrize("file, words", [
    (dict(architecture="llama"), "is not an mmproj file with a vision encoder"),
    (dict(projector="glm4v"), "its vision projector 'glm4v' is not one lmport runs from an mmproj file; it runs "
                              "qwen2.5vl_merger (Qwen2.5-VL, with a qwen2vl text model), qwen3vl_merger (Qwen3-VL, "
                              "with a qwen3vl text model), gemma3 (Gemma 3, with a gemma3 text model), pixtral "
                              "(Mistral 3 / Pixtral, with a mistral3 text model), idefics3 (SmolVLM / Idefics3, with "
                              "a llama text model), llama4 (Llama 4, with a llama4 text model)"),
])
def test_a_file_that_is_no_mmproj_lmport_runs_is_refused(file, words, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(words)):
        mmproj_files.read_mmproj(metadata_only_mmproj(tmp_path / "other.gguf", **file))
    with pytest.raises(ConfigError, match="is not a file"):
        mmproj_files.read_mmproj(tmp_path / "missing.gguf")


def test_an_mmproj_of_another_model_names_both_files(pair, tmp_path):
    """A mismatched pair (the tower's embeddings narrower than the text model's) is refused before a weight loads,
    naming both files and both widths."""
    text, _ = pair
    other = metadata_only_mmproj(tmp_path / "mmproj-other.gguf", projection_dim=32)
    with pytest.raises(ConfigError, match=re.escape(f"mmproj-other.gguf does not belong to {text.name}: its vision "
                                                    f"tower gives embeddings of 32 values, the text model's are 64")):
        engine(text, other)


def test_a_llama4_mmproj_without_its_adapter_and_projector_is_refused(tmp_path):
    """A Llama 4 mmproj missing the pixel-shuffle adapter's and the projector's tensors is refused before a weight
    loads, naming each missing tensor."""
    from transformers import Llama4TextConfig
    text = tmp_path / "llama4.gguf"
    writer = gguf.GGUFWriter(text, "llama4")
    writer.add_uint32("llama4.embedding_length", 64)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    mmproj = metadata_only_mmproj(tmp_path / "mmproj.gguf", projector="llama4")
    with pytest.raises(ConfigError, match=re.escape(
            "mmproj.gguf: no mm.model.mlp.1.weight, mm.model.mlp.2.weight, mm.model.fc.weight (Llama 4's "
            "pixel-shuffle adapter and projector); the file is not a complete mmproj of the model")):
        mmproj_files.checkpoint_config(text, mmproj, Llama4TextConfig(hidden_size=64))


def test_an_empty_mmproj_path_is_refused_by_the_config():
    with pytest.raises(ConfigError, match="mmproj must be the path of an mmproj GGUF file"):
        EngineConfig(mmproj=" ")


def test_the_text_gguf_alone_runs_as_a_text_model(pair):
    """Without --mmproj the text GGUF is Qwen2's decoder (its multimodal rotary turns text as the plain one does)
    and takes no images."""
    from lmport.models.loader import read_model_config
    text, _ = pair
    assert read_model_config(str(text)).model_type == "qwen2"
    assert not takes_images(str(text)) and takes_images(str(text), "mmproj.gguf")


# -- served, and against llama.cpp ---------------------------------------------------------------------------

@pytest.mark.slow   # a server process: its imports and the model's load
def test_lmport_serve_with_mmproj_answers_as_the_source_directory(pair, source_dir, source_llm, tmp_path):
    """`lmport serve text.gguf --mmproj mmproj.gguf`: the official openai client's chat with a data: URL image gets
    the greedy answer lmport gives on the source directory."""
    import openai

    from support.cli_helpers import lmport_command
    from support.serve_process import ServeProcess
    text, mmproj = pair
    parts = CASES["one image, text before and after"]
    ids, images = prompt(source_llm, source_dir, None, parts)
    want = source_llm.tokenizer.decode(generate_greedy(source_llm, ids, images, NEW_TOKENS).token_ids,
                                       skip_special_tokens=True)
    flags = ["--mmproj", str(mmproj), "--device", "cpu", "--dtype", "float32", "--cache-max-entry-count", "64"]
    server = ServeProcess(lmport_command(), [str(text), *flags], tmp_path / "serve.log").ready()
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        content = [{"type": "text", "text": p} if isinstance(p, str) else
                   {"type": "image_url", "image_url": {"url": data_url(p)}} for p in parts]
        reply = client.chat.completions.create(model=str(text), messages=[{"role": "user", "content": content}],
                                               temperature=0, max_tokens=NEW_TOKENS, extra_body={"ignore_eos": True})
        assert reply.usage is not None and reply.usage.prompt_tokens == len(ids)
        assert reply.choices[0].message.content == want
    finally:
        server.stop()


@pytest.mark.slow   # llama-server's start
def test_llama_server_on_the_same_pair_gives_the_same_tokens(pair, pair_llm, tmp_path):
    """llama.cpp's llama-server with the same two files (``-m text.gguf --mmproj mmproj.gguf``), its /completion
    with the image in ``multimodal_data``: the same prompt length and greedy tokens as lmport's. Images whose sides
    are whole 28-pixel cells, which neither resizes (llama.cpp's bicubic resize is its own)."""
    from support.llama_server import LlamaServer
    from test_gguf_llama_cpp import llama_cpp
    _, bins = llama_cpp()
    binary = bins / "llama-server" if bins else None
    if binary is None or not binary.exists():
        pytest.skip(f"llama.cpp's llama-server not found in {bins} (set LMPORT_LLAMA_CPP_BIN)")
    text, mmproj = pair
    with LlamaServer(binary, text, tmp_path / "llama-server.log", extra=("--mmproj", str(mmproj))) as server:
        assert server.client is not None
        marker = server.client.get("/props").json()["media_marker"]
        for image in (png(112, 84, 5), png(56, 140, 6)):
            parts = ("Look at this:", image, "What is it?")
            ids, images = prompt(pair_llm, *pair, parts)
            want = generate_greedy(pair_llm, ids, images, NEW_TOKENS).token_ids
            rendered = pair_llm.tokenizer.apply_chat_template(conversation(*parts), tokenize=False,
                                                              add_generation_prompt=True)
            # llama.cpp's mtmd writes <|vision_start|> and <|vision_end|> around the image's embeddings itself
            rendered = rendered.replace("<|vision_start|><|image_pad|><|vision_end|>", marker)
            reply = server.client.post("/completion", json={
                "prompt": {"prompt_string": rendered, "multimodal_data": [base64.b64encode(image).decode()]},
                "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1, "samplers": ["top_k"], "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False}).json()
            assert reply["tokens_evaluated"] == len(ids), reply
            assert reply["tokens"] == want


def _with_img_break(text: Path, mmproj: Path, out: Path) -> Path:
    """``mmproj`` with the ``v.token_embd.img_break`` tensor llama.cpp's Pixtral reads: the text model's embedding of
    ``[IMG_BREAK]``, which the converter takes from the checkpoint's embedding but finds no longer under a
    transformers-saved checkpoint's names (``language_model.`` ones, which the mmproj's filter drops)."""
    from support.llama_cpp_tokens import metadata_fields
    break_id = mmproj_files.placeholder_ids(text, {"break": "[IMG_BREAK]"})["break"]
    embedding = next(t for t in gguf.GGUFReader(text).tensors if t.name == "token_embd.weight")
    writer = gguf.GGUFWriter(out, "clip")
    for key, value, kind, element in metadata_fields(mmproj):
        if key not in ("general.architecture", "GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"):
            writer.add_key_value(key, value, gguf.GGUFValueType(kind),
                                 sub_type=gguf.GGUFValueType(element) if element is not None else None)
    for tensor in gguf.GGUFReader(mmproj).tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.add_tensor("v.token_embd.img_break", np.array(embedding.data[break_id], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


# Per family: images whose sides neither lmport's processor nor llama.cpp's resizes (whole merged cells, within
# llama.cpp's token limits; Gemma 3's the tower's size), and what llama.cpp's mtmd writes around an image itself.
_LLAMA_CPP_IMAGES = {"gemma3": ((32, 32), (32, 32)), "mistral3": ((64, 32), (48, 48)),
                     "qwen3-vl": ((128, 64), (96, 96))}
_TEMPLATE_IMAGE = {"gemma3": ("<start_of_image>", "\n\n{marker}\n\n"), "mistral3": ("[IMG]", "{marker}"),
                   "qwen3-vl": ("<|vision_start|><|image_pad|><|vision_end|>", "{marker}")}


@pytest.mark.slow   # llama-server's start
@pytest.mark.parametrize("family", ["gemma3", "mistral3", "qwen3-vl"])
def test_llama_server_on_a_familys_pair_gives_the_same_tokens(family, family_engines, tmp_path):
    """llama.cpp's llama-server with the family's two files, its /completion with the image in ``multimodal_data``:
    the same prompt length and greedy tokens as lmport's on the pair."""
    from support.llama_server import LlamaServer
    from test_gguf_llama_cpp import llama_cpp
    _, bins = llama_cpp()
    binary = bins / "llama-server" if bins else None
    if binary is None or not binary.exists():
        pytest.skip(f"llama.cpp's llama-server not found in {bins} (set LMPORT_LLAMA_CPP_BIN)")
    text, mmproj = converted_pair("f32", family)
    _, pair_llm = family_engines(family)
    if family == "mistral3":
        mmproj = _with_img_break(text, mmproj, tmp_path / "mmproj-with-break.gguf")
    placeholder, replacement = _TEMPLATE_IMAGE[family]
    with LlamaServer(binary, text, tmp_path / "llama-server.log", extra=("--mmproj", str(mmproj))) as server:
        assert server.client is not None
        marker = server.client.get("/props").json()["media_marker"]
        for seed, (width, height) in enumerate(_LLAMA_CPP_IMAGES[family], start=5):
            image = png(width, height, seed)
            parts = ("Look at this:", image, "What is it?")
            ids, images = prompt(pair_llm, text, mmproj, parts)
            want = generate_greedy(pair_llm, ids, images, NEW_TOKENS).token_ids
            rendered = pair_llm.tokenizer.apply_chat_template(conversation(*parts), tokenize=False,
                                                              add_generation_prompt=True)
            assert rendered.count(placeholder) == 1
            rendered = rendered.replace(placeholder, replacement.format(marker=marker))
            reply = server.client.post("/completion", json={
                "prompt": {"prompt_string": rendered, "multimodal_data": [base64.b64encode(image).decode()]},
                "n_predict": NEW_TOKENS, "temperature": 0, "top_k": 1, "samplers": ["top_k"], "ignore_eos": True,
                "return_tokens": True, "cache_prompt": False}).json()
            assert reply["tokens_evaluated"] == len(ids), reply
            assert reply["tokens"] == want


@pytest.mark.slow   # two more conversions
def test_an_f16_mmproj_loads_its_values_in_the_compute_dtype(source_dir):
    """``--outtype f16``: the tower's tensors are the file's F16 values (the checkpoint's rounded to float16; its
    norms and biases the converter keeps F32, exact) in float32, the compute dtype."""
    from transformers import AutoModelForImageTextToText

    from lmport.models.loader import read_model_config
    text, mmproj = converted_pair("f16")
    types = {t.name: gguf.GGMLQuantizationType(t.ggml_type) for t in mmproj_files.read_mmproj(mmproj).tensors}
    assert gguf.GGMLQuantizationType.F16 in set(types.values())
    made = mmproj_files.checkpoint_config(text, mmproj, read_model_config(str(text)))
    tower = mmproj_files.vision_tower(mmproj, made.vision_config, torch.float32)
    source = AutoModelForImageTextToText.from_pretrained(source_dir, dtype=torch.float32).model.visual.state_dict()
    halves = 0
    for name, value in tower.state_dict().items():
        assert value.dtype == torch.float32, name
        want = source[name]
        if not torch.equal(value, want):
            assert torch.equal(value, want.half().float()), name
            halves += 1
    assert halves > 0
