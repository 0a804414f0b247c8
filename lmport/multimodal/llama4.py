"""Llama 4's images in the front end, as transformers' ``Llama4ImageProcessor`` and ``Llama4Processor`` make them.

The image processor picks the canvas of whole ``size`` tiles (at most ``max_patches`` of them) that needs the least
resizing, resizes the image into it keeping its aspect ratio (bilinear with antialiasing, never upscaling past one
tile's side unless ``resize_to_max_canvas``), pads it on the right and bottom with zeros, and cuts it into tiles, row
by row; an image of more than one tile gets a global view too: the whole image resized to one tile, last. The pixels
are rescaled and normalized in bfloat16, as the original implementation does. transformers' processor needs
torchvision, which lmport does not: the same steps are written here with torch's own ops (those torchvision calls).

The chat template writes one ``<|image|>`` for each image; ``Llama4Processor`` replaces it with ``<|image_start|>``,
then, for an image of several tiles, each row of tiles as runs of ``<|patch|>`` (one run a tile) separated by
``<|tile_x_separator|>`` and ended by ``<|tile_y_separator|>``, then ``<|image|>``, the global view's (or the single
tile's) run of ``<|patch|>``, and ``<|image_end|>``. A tile gives (tile / patch_size)^2 x pixel_shuffle_ratio^2
tokens. Each tile's run of ``<|patch|>`` (the model's image token) is one ``ImageInput``: the vision tower encodes
each tile on its own, so a chunked prefill encodes only the tiles a step computes."""
from __future__ import annotations

import json
import math
import platform
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from lmport.multimodal.images import ImageLimits, digest
from lmport.multimodal.inputs import ImageInput
from lmport.multimodal.processor import ImageProcessor, placed_images

if TYPE_CHECKING:   # imported where used: the server app imports this module and must not load torch
    import torch

LLAMA4_MODEL_TYPES = ("llama4",)
# Llama4Processor's tokens and their defaults (processor_config.json may name others)
TOKEN_DEFAULTS = {"image_token": "<|image|>", "start_of_image_token": "<|image_start|>",
                  "end_of_image_token": "<|image_end|>", "patch_token": "<|patch|>",
                  "tile_x_separator_token": "<|tile_x_separator|>", "tile_y_separator_token": "<|tile_y_separator|>"}
BILINEAR = 2   # PIL's resample code, the only one Llama4ImageProcessor is used with


def supported_canvases(max_tiles: int, tile: int) -> list[tuple[int, int]]:
    """The canvases (height, width) of whole tiles, at most ``max_tiles`` of them, in the order transformers'
    ``find_supported_resolutions`` lists them (its ties are broken by that order)."""
    by_ratio: dict[float, list[tuple[int, int]]] = {}
    for count in range(max_tiles, 0, -1):
        for rows in sorted(d for d in range(1, count + 1) if count % d == 0):
            by_ratio.setdefault(rows / (count // rows), []).append((rows, count // rows))
    return [(rows * tile, cols * tile) for shapes in by_ratio.values() for rows, cols in shapes]


def best_canvas(height: int, width: int, canvases: list[tuple[int, int]], to_max: bool) -> tuple[int, int]:
    """transformers' ``get_best_fit``: the canvas the image fits with the least upscaling (the most, ``to_max``), or
    the least downscaling where none fits, the smallest such canvas on a tie. Computed in float32 as there."""
    import torch
    sizes = torch.tensor(canvases)
    scales = torch.minimum(sizes[:, 1] / width, sizes[:, 0] / height)
    up = scales[scales >= 1]
    chosen = (up.max() if to_max else up.min()) if len(up) else scales[scales < 1].max()
    fits = sizes[scales == chosen]
    return tuple(int(v) for v in fits[torch.argmin(fits[:, 0] * fits[:, 1])])   # pyright: ignore[reportReturnType]


def fitted_size(height: int, width: int, target_height: int, target_width: int) -> tuple[int, int]:
    """transformers' ``get_max_res_without_distortion``: the largest size within the target keeping the ratio."""
    scale_w, scale_h = target_width / width, target_height / height
    if scale_w < scale_h:
        return max(min(math.floor(height * scale_w), target_height), 1), max(target_width, 1)
    return max(target_height, 1), max(min(math.floor(width * scale_h), target_width), 1)


def resize_bilinear(image: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """torchvision's ``resize`` of a uint8 [1, channels, h, w] image (bilinear, antialiased): torch's uint8 kernel
    where torchvision takes it (AVX2 / AVX512 / ARM cpus), else in float32, rounded."""
    import torch
    if tuple(image.shape[-2:]) == (height, width):
        return image
    native = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") or platform.machine() in ("aarch64",
                                                                                                      "arm64")
    x = image if native else image.float()
    out = torch.nn.functional.interpolate(x, size=[height, width], mode="bilinear", align_corners=False,
                                          antialias=True)
    return out if native else out.round_().to(torch.uint8)


class Llama4ImageProcessor(ImageProcessor):
    """Images to a prompt's ``ImageInput`` (one a tile) for a Llama 4 model."""

    def __init__(self, settings: dict, token_ids: dict[str, int], patch_size: int, shuffle_ratio: float):
        size = settings.get("size") or {"height": 336, "width": 336}
        if size.get("height") != size.get("width"):
            raise ValueError(f"Llama 4's image processor takes square tiles; its size is {size}")
        for key, want in (("do_resize", True), ("resample", BILINEAR)):
            if settings.get(key, want) != want:
                raise ValueError(f"Llama 4's image processor with {key}={settings[key]!r} is not supported; lmport "
                                 f"runs it with {key}={want!r}, as the released checkpoints are")
        self.tile = int(size["height"])
        self.max_tiles = int(settings.get("max_patches", 16))
        self.to_max = bool(settings.get("resize_to_max_canvas", False))
        self.do_rescale, self.do_normalize = settings.get("do_rescale", True), settings.get("do_normalize", True)
        if self.do_normalize and not self.do_rescale:
            raise ValueError("Llama 4's image processor with do_normalize and not do_rescale is not supported (it "
                             "normalizes the rescaled bfloat16 pixels); set do_rescale to true")
        self.rescale_factor = float(settings.get("rescale_factor", 1 / 255))
        self.mean, self.std = settings.get("image_mean", [0.5] * 3), settings.get("image_std", [0.5] * 3)
        self.tokens, self.patch_size = token_ids, patch_size
        self.tile_tokens = (self.tile // patch_size) ** 2 // int(round(1.0 / shuffle_ratio ** 2))
        self.image_token_id = token_ids["patch_token"]        # the token whose embeddings the tower's rows replace
        self.placeholder_id = token_ids["image_token"]        # what the chat template writes for each image
        self.canvases = supported_canvases(self.max_tiles, self.tile)

    @classmethod
    def load(cls, path: Path) -> Llama4ImageProcessor:
        """The processor of the transformers directory ``path``: its ``preprocessor_config.json``, the patch size,
        pixel shuffle ratio and token names of its ``processor_config.json`` (Llama4Processor's defaults where it has
        none), the tokens' ids from its tokenizer."""
        from transformers import AutoConfig, AutoTokenizer
        config = AutoConfig.from_pretrained(path)
        settings_file = path / "preprocessor_config.json"
        if not settings_file.is_file():
            raise ValueError(f"{path}: no preprocessor_config.json; a Llama 4 image-text checkpoint's directory holds "
                             f"its image processor's settings there (the released checkpoints do)")
        settings = json.loads(settings_file.read_text())
        processor_file = path / "processor_config.json"
        processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
        tokenizer = AutoTokenizer.from_pretrained(path)
        token_ids = {}
        for key, default in TOKEN_DEFAULTS.items():
            name = processor.get(key, default)
            token_id = tokenizer.convert_tokens_to_ids(name)
            if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != name:
                raise ValueError(f"{path}: the tokenizer has no {name} token; Llama 4's images need "
                                 f"{', '.join(processor.get(k, d) for k, d in TOKEN_DEFAULTS.items())} as tokens "
                                 f"of its vocabulary")
            token_ids[key] = token_id
        if token_ids["patch_token"] != config.image_token_id:
            raise ValueError(f"{path}: the tokenizer's {processor.get('patch_token', '<|patch|>')} is token "
                             f"{token_ids['patch_token']}, the model's image token (config.json image_token_index) "
                             f"is {config.image_token_id}; they must be one token")
        return cls(settings, token_ids, int(processor.get("patch_size", 14)),
                   float(processor.get("pixel_shuffle_ratio", 0.5)))

    def prepare(self, prompt_ids: list[int], images: list[bytes], limits: ImageLimits,
                wheres: list[str] | None = None) -> tuple[list[int], list[ImageInput]]:
        ids: list[int] = []
        inputs: list[ImageInput] = []
        start = 0
        grid = (1, self.tile // self.patch_size, self.tile // self.patch_size)
        for place, image, data in placed_images(prompt_ids, self.placeholder_id, images, limits, wheres):
            ids += prompt_ids[start:place]
            tiles, rows, cols = self.tiles(image)
            layout, runs = self.layout(rows, cols)
            name = digest(data)
            for k, (first, tile) in enumerate(zip(runs, tiles, strict=True)):
                inputs.append(ImageInput(len(ids) + first, self.tile_tokens, grid, f"{name}:{k}", tile))
            ids += layout
            start = place + 1
        return ids + prompt_ids[start:], inputs

    def layout(self, rows: int, cols: int) -> tuple[list[int], list[int]]:
        """The token ids that replace an image's ``<|image|>`` (Llama4Processor's ``_prompt_split_image``) for a
        canvas of ``rows`` x ``cols`` tiles, and where each tile's run of patch tokens starts in them (the global
        view's last)."""
        t, patches = self.tokens, [self.tokens["patch_token"]] * self.tile_tokens
        out, runs = [t["start_of_image_token"]], []
        if rows * cols > 1:
            for _ in range(rows):
                for x in range(cols):
                    runs.append(len(out))
                    out += patches
                    if x < cols - 1:
                        out.append(t["tile_x_separator_token"])
                out.append(t["tile_y_separator_token"])
        out.append(t["image_token"])
        runs.append(len(out))
        return out + patches + [t["end_of_image_token"]], runs

    def tiles(self, image) -> tuple[list[np.ndarray], int, int]:
        """One image's tiles, row by row, then (for more than one) its global view, each [channels, tile, tile]
        float32 (values of bfloat16); and its canvas's rows and columns of tiles."""
        import torch
        from transformers.image_transforms import convert_to_rgb
        pixels = torch.from_numpy(np.ascontiguousarray(convert_to_rgb(image, return_numpy=True)))
        pixels = pixels.permute(2, 0, 1).contiguous()[None]   # [1, 3, h, w] uint8
        height, width = pixels.shape[-2:]
        canvas = best_canvas(height, width, self.canvases, self.to_max)
        bound = canvas if self.to_max else (min(max(height, self.tile), canvas[0]), min(max(width, self.tile),
                                                                                           canvas[1]))
        fitted = resize_bilinear(pixels, *fitted_size(height, width, *bound))
        padded = torch.nn.functional.pad(fitted, (0, canvas[1] - fitted.shape[-1], 0, canvas[0] - fitted.shape[-2]))
        rows, cols = canvas[0] // self.tile, canvas[1] // self.tile
        grid = self.normalized(padded)[0].unflatten(1, (rows, self.tile)).unflatten(3, (cols, self.tile))
        tiles = [grid[:, r, :, c] for r in range(rows) for c in range(cols)]
        if rows * cols > 1:
            tiles.append(self.normalized(resize_bilinear(pixels, self.tile, self.tile))[0])
        return [t.float().contiguous().numpy() for t in tiles], rows, cols

    def normalized(self, image: torch.Tensor) -> torch.Tensor:
        """Llama4ImageProcessor's ``rescale_and_normalize``: in bfloat16, as the original implementation."""
        import torch
        if not self.do_rescale:
            return image.float()
        if not self.do_normalize:
            return image * self.rescale_factor
        image = image.to(torch.bfloat16) * self.rescale_factor
        mean = torch.as_tensor(self.mean, dtype=image.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=image.dtype).view(-1, 1, 1)
        return image.sub(mean).div_(std)
