"""The memory plan's vision side: the tower's weights, the encoder's activation reserve (Llama 4's too) and the
encoder cache are counted before the KV cache is sized, by ``lmport plan`` and the engine alike.

References: the engine's loaded vision modules' parameter bytes (the weights' line); the bytes of the tensors an
image's prefill step creates, tracked op by op (a dispatch mode holding each new storage until its last tensor
goes: deterministic, no RSS, no clock) for the encoder's line and the step's whole peak; the rows the engine's
encoder cache holds for the encoder cache's line; the plan's own figures for the cache arithmetic."""
from __future__ import annotations

import json
import math
import os
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lmport.config import EngineConfig
from lmport.memory.budget import encoder_reserve
from lmport.memory.plan import build_plan
from lmport.memory.plan_format import format_plan
from lmport.multimodal.encoder_cache import ENCODER_CACHE_ROWS
from support.vision_helpers import (generate_greedy, lmport_prompt, png, tiny_llama4_dir, tiny_qwen2_5_vl_dir,
                                    tiny_qwen3_vl_dir, vision_engine)

DEVICE_MEMORY = 4 << 30


class LiveBytes(TorchDispatchMode):
    """The peak of the bytes held by storages that ops create while the mode is on: a storage counts from the op
    that makes it until no tensor made inside the mode holds it (outputs that alias an input are views, not new
    storage)."""

    def __init__(self):
        super().__init__()
        self.holders: dict[int, int] = {}   # storage address -> live tensors made here that hold it
        self.sizes: dict[int, int] = {}
        self.live = self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
                continue
            address = t.untyped_storage().data_ptr()
            if address == 0 or (address in inputs and address not in self.holders):
                continue   # empty, or a view of a tensor made before the mode (a weight, the cache)
            if address not in self.holders:
                self.holders[address], self.sizes[address] = 0, t.untyped_storage().nbytes()
                self.live += self.sizes[address]
                self.peak = max(self.peak, self.live)
            self.holders[address] += 1
            weakref.finalize(t, self._release, address)
        return out

    def _release(self, address: int) -> None:
        if address in self.holders:
            self.holders[address] -= 1
            if self.holders[address] == 0:
                del self.holders[address]
                self.live -= self.sizes.pop(address)


def _config(**fields) -> EngineConfig:
    return EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=0.05, **fields)


# The families whose one-image prefill is checked against the plan: the checkpoint, the engine's vision modules
# (what the weights' line counts) and the call the encoder's line covers (a module's forward, wrapped).
FAMILIES = {"qwen2.5-vl": (tiny_qwen2_5_vl_dir, ("visual",), "visual"),
            "llama4": (tiny_llama4_dir, ("vision_model", "projector"), "run_tower")}
# The checkpoints of the encoder cache's check: these and Qwen3-VL, whose rows hold its deepstack sets.
CHECKPOINTS = {family: made for family, (made, _, _) in FAMILIES.items()} | {"qwen3-vl": tiny_qwen3_vl_dir}


@pytest.fixture(scope="module")
def plans():
    made: dict[str, dict] = {}

    def get(family: str) -> dict:
        if family not in made:
            made[family] = build_plan(CHECKPOINTS[family](), _config(), device_memory=DEVICE_MEMORY)
        return made[family]
    return get


@pytest.fixture(scope="module")
def engines():
    made = {}

    def get(family: str):
        if family not in made:
            made[family] = vision_engine(CHECKPOINTS[family]())
        return made[family]
    yield get
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def plan(plans) -> dict:
    return plans("qwen2.5-vl")


@pytest.fixture(scope="module")
def llm(engines):
    return engines("qwen2.5-vl")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_plan_counts_the_towers_weights_as_the_engine_holds_them(family, plans, engines):
    """The plan's vision weights (from the checkpoint's headers) are the bytes of the vision modules the engine
    loads; they are counted before the cache: the memory free after weights is the device's less the text
    weights and the tower's."""
    model = engines(family).core.runner.model
    held = sum(p.numel() * p.element_size() for name in FAMILIES[family][1] for p in getattr(model, name).parameters())
    plan = plans(family)
    vision = plan["vision"]
    assert vision is not None and vision["weight_bytes"] == held > 0
    assert plan["free_after_weights_bytes"] == DEVICE_MEMORY - plan["weights"]["bytes"] - held


@pytest.mark.parametrize("family", FAMILIES)
def test_the_encoder_reserve_and_cache_are_set_aside_before_the_cache(family, plans, engines):
    """The KV cache gets what is left after the text model's activation reserve, the encoder's and the encoder cache
    at its most, in the plan and in the engine alike; the plan's text shows the tower's weights and the encoder's
    reserve and cache as their own lines."""
    plan = plans(family)
    vision = plan["vision"]
    assert vision["encoder_reserve_bytes"] > 0 and vision["encoder_cache_bytes"] > 0
    assert plan["usable_for_cache_bytes"] == (plan["free_after_weights_bytes"] - plan["activation_reserve"]["bytes"]
                                              - vision["encoder_reserve_bytes"] - vision["encoder_cache_bytes"])
    inputs = engines(family).core.runner.memory_inputs
    assert (inputs.encoder_bytes, inputs.encoder_cache_bytes) == (vision["encoder_reserve_bytes"],
                                                                  vision["encoder_cache_bytes"])
    text = format_plan(plan)
    assert any(line.startswith("vision ") for line in text.splitlines())
    assert any(line.startswith("encoder ") for line in text.splitlines())
    assert any(line.startswith("encoder cache ") and f"{vision['encoder_cache_bytes']:,} B" in line
               for line in text.splitlines())


def test_the_largest_image_is_the_directorys_processor_limit(plan, tmp_path):
    """A Qwen image's patches at most follow the directory's processor settings (``size.longest_edge``, or a
    legacy ``max_pixels``), not transformers' default: a processor allowing a quarter of the pixels gets a quarter of
    the patches and a smaller reserve."""
    source = Path(tiny_qwen2_5_vl_dir())
    settings = json.loads((source / "preprocessor_config.json").read_text())
    patch = settings["patch_size"]
    assert plan["vision"]["largest_image_patches"] == math.ceil(settings["size"]["longest_edge"] / patch ** 2)
    for name in os.listdir(source):
        if name != "preprocessor_config.json":
            (tmp_path / name).symlink_to(source / name)
    smaller = {**settings, "max_pixels": settings["size"]["longest_edge"] // 4}
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(smaller))
    quarter = build_plan(str(tmp_path), _config(), device_memory=DEVICE_MEMORY)["vision"]
    assert quarter["largest_image_patches"] == math.ceil(smaller["max_pixels"] / patch ** 2)
    assert quarter["encoder_reserve_bytes"] < plan["vision"]["encoder_reserve_bytes"]


def test_a_text_model_has_no_vision_lines():
    plan = build_plan("smollm2", _config(), device_memory=DEVICE_MEMORY)
    assert plan["vision"] is None
    assert "encoder " not in format_plan(plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_one_image_prefill_stays_within_the_plan(family, plans, engines):
    """The engine's one-image prefill step: the bytes the vision encoder's call creates stay within the plan's
    encoder reserve (and within its per-patch figure at this image's patches: Llama 4's tiles, each with its class
    token), and the whole step's within the two reserves; the engine plans its cache with the same encoder reserve
    as ``lmport plan``."""
    plan, llm = plans(family), engines(family)
    runner = llm.core.runner
    owner = runner.model if family == "llama4" else runner.model.visual
    name = "run_tower" if family == "llama4" else "forward"
    run_tower = getattr(owner, name)
    runner.model.encoded.entries.clear()   # encoded whole in this step, not taken from an earlier test's
    runner.model.encoded.held = 0
    try:
        assert runner.memory_inputs.encoder_bytes == plan["vision"]["encoder_reserve_bytes"] == encoder_reserve(
            runner.model_config, runner.config).bytes
        ids, images = lmport_prompt(llm, FAMILIES[family][0](), ("Look at this:", png(150, 90, 3), "What is it?"))
        encoder = LiveBytes()

        def measured(*args, **kwargs):
            with encoder:
                return run_tower(*args, **kwargs)
        setattr(owner, name, measured)
        step = LiveBytes()
        with step:
            generate_greedy(llm, ids, images, 1)
    finally:
        setattr(owner, name, run_tower)
        if family == "llama4":
            del owner.run_tower   # the class's method again
    vision = plan["vision"]
    assert 0 < encoder.peak <= vision["encoder_reserve_bytes"]
    # the estimate is linear in the call's patches (neither family's attention is materialized as a mask): scaled
    # down to this image's patches it still covers what the call made
    patches = sum(math.prod(im.grid_thw) + (family == "llama4") for im in images)
    assert encoder.peak <= vision["encoder_reserve_bytes"] * patches / vision["patches_per_call"]
    assert encoder.peak <= step.peak <= plan["activation_reserve"]["bytes"] + plan["vision"]["encoder_reserve_bytes"]


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3-vl"])
def test_the_encoder_cache_line_is_the_rows_the_engine_keeps(family, plans, engines):
    """The encoder cache's line is its row limit times the bytes of one row the engine's encoder cache keeps (an
    image token's row, the text model's width in the compute dtype; Qwen3-VL's with its deepstack sets), after a
    one-image prefill filled it."""
    llm = engines(family)
    cache = llm.core.runner.model.encoded
    ids, images = lmport_prompt(llm, CHECKPOINTS[family](), ("Look at this:", png(90, 60, 5), "What is it?"))
    generate_greedy(llm, ids, images, 1)
    held = [cache.entries[im.digest] for im in images]
    assert [len(rows) for rows in held] == [im.num_tokens for im in images]
    row_bytes = {rows.untyped_storage().nbytes() // len(rows) if rows.is_contiguous() else None for rows in held}
    vision = plans(family)["vision"]
    assert cache.rows == vision["encoder_cache_rows"] == ENCODER_CACHE_ROWS
    assert row_bytes == {vision["encoder_cache_bytes"] // ENCODER_CACHE_ROWS}


@pytest.mark.slow   # a pair converted by llama.cpp's converter
@pytest.mark.parametrize("family", ["gemma3", "llama4"])
def test_an_mmproj_pairs_plan_counts_the_mmproj_tower(family):
    """`lmport plan text.gguf --mmproj mmproj.gguf` (Gemma 3's and Llama 4's pairs): the vision weights are the bytes
    of the tower and projector the engine builds from the mmproj, the largest image the mmproj's size (Llama 4's: a
    tile and its class token), and the engine plans with the same encoder reserve and encoder cache."""
    from test_vision_gguf import converted_pair, engine
    text, mmproj = converted_pair("f32", family)
    plan = build_plan(str(text), _config(mmproj=str(mmproj)), device_memory=DEVICE_MEMORY)
    llm = engine(text, mmproj)
    try:
        runner = llm.core.runner
        names = ("vision_model", "projector") if family == "llama4" else ("vision_tower", "projector")
        held = sum(p.numel() * p.element_size() for name in names for p in getattr(runner.model, name).parameters())
        encoder, cache = runner.memory_inputs.encoder_bytes, runner.memory_inputs.encoder_cache_bytes
        patch, size = runner.model_config.vision_config.patch_size, runner.model_config.vision_config.image_size
    finally:
        llm.close()
    assert plan["vision"]["source"] == "mmproj" and plan["vision"]["weight_bytes"] == held > 0
    assert plan["vision"]["largest_image_patches"] == (size // patch) ** 2 + (family == "llama4")
    assert plan["vision"]["encoder_reserve_bytes"] == encoder > 0
    assert plan["vision"]["encoder_cache_bytes"] == cache > 0
