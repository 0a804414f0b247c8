"""Read a peft LoRA adapter directory (adapter_config.json and adapter_model.safetensors or .bin) and check
it against the model before any of it reaches the device.

What is served: plain LoRA (``peft_type`` "LORA") on the Llama-family projections q/k/v/o and
gate/up/down, any rank up to ``max_lora_rank`` (per module, so ``rank_pattern`` works), scaling
``lora_alpha / r`` (``lora_alpha / sqrt(r)`` with ``use_rslora``). Refused with the reason: DoRA, trained
biases, ``modules_to_save``, ``alpha_pattern``, other target modules, tensors of the wrong shape or not finite.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

import torch

from lmport.lora import AdapterError
from lmport.models.lora import TARGET_MODULES

log = logging.getLogger(__name__)

CONFIG_FILE = "adapter_config.json"
MAX_CONFIG_BYTES = 2**20   # a peft adapter_config.json is a few KB; more is not an adapter's config
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (the adapter name, if saved, before .weight)
_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(layers\.\d+\.(?:self_attn|mlp)\.(\w+))"
                  r"\.lora_([AB])(?:\.[\w-]+)?\.weight$")


@dataclass(frozen=True)
class PeftAdapter:
    path: str
    rank: int                 # the highest rank of its modules
    weights: dict             # module ("layers.3.self_attn.q_proj") -> (A [r, in], B [out, r] x scaling)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _refuse(message: str) -> AdapterError:
    return AdapterError(f"lora_path: {message}", param="lora_path")


def _unloadable(why: str, file: Path) -> AdapterError:
    """A refusal that names no server path (the client may not know the server's disk); the log has the path."""
    log.warning("LoRA adapter file %s refused: %s", file, why)
    return AdapterError(f"lora_path: the adapter could not be loaded: {why}", param="lora_path")


def _read_regular(file: Path, limit: int) -> bytes:
    """The bytes of ``file``, a regular file of at most ``limit`` bytes; AdapterError otherwise. Opened without
    blocking, so a FIFO or device never holds the reader."""
    fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _unloadable(f"{file.name} is not a regular file", file)
        chunks, size = [], 0
        while size <= limit and (chunk := os.read(fd, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
        if size > limit:
            raise _unloadable(f"{file.name} is larger than {limit} bytes", file)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_config(path: Path) -> dict:
    if not path.is_dir():
        raise _refuse(f"{str(path)!r} is not a directory (a peft adapter directory holds {CONFIG_FILE} and "
                      f"{WEIGHT_FILES[0]})")
    try:
        config = json.loads(_read_regular(path / CONFIG_FILE, MAX_CONFIG_BYTES).decode())
    except FileNotFoundError:
        raise _refuse(f"{str(path)!r} has no {CONFIG_FILE}: give a directory saved by peft's "
                      f"save_pretrained") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _refuse(f"{path / CONFIG_FILE} cannot be read: {exc}") from None
    if not isinstance(config, dict):
        raise _refuse(f"{path / CONFIG_FILE} is not a JSON object")
    return config


def _check_config(config: dict, max_rank: int) -> tuple[float, bool]:
    """(lora_alpha, use_rslora) of a config lmport serves, else AdapterError naming the key."""
    if config.get("peft_type", "LORA") != "LORA":
        raise _refuse(f"peft_type {config.get('peft_type')!r} is not served; only LORA adapters are")
    r = config.get("r")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise _refuse(f"{CONFIG_FILE} has r={r!r}; the rank must be an int >= 1")
    if r > max_rank:
        raise _refuse(f"{CONFIG_FILE} has r={r}, above max_lora_rank={max_rank}; restart with a max_lora_rank "
                      f">= {r} or use an adapter of rank <= {max_rank}")
    for key, why in (("use_dora", "DoRA adapters"), ("modules_to_save", "modules_to_save (fully trained modules)"),
                     ("alpha_pattern", "alpha_pattern")):
        if config.get(key):
            raise _refuse(f"{key} is set in {CONFIG_FILE}: {why} are not served; only plain LoRA is")
    if config.get("bias", "none") != "none":
        raise _refuse(f"bias={config['bias']!r} in {CONFIG_FILE}: trained biases are not served; use bias='none'")
    alpha = config.get("lora_alpha", r)
    if not isinstance(alpha, int | float) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise _refuse(f"{CONFIG_FILE} has lora_alpha={alpha!r}; it must be a finite number")
    return float(alpha), bool(config.get("use_rslora", False))


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        file = path / name
        if not file.exists():
            continue
        if not file.is_file():   # a FIFO or device would block the reader
            raise _unloadable(f"{name} is not a regular file", file)
        try:
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(str(file))
            tensors = torch.load(file, map_location="cpu", weights_only=True)
            if not isinstance(tensors, dict):
                raise ValueError("not a state dict")
            return tensors
        except Exception as exc:  # safetensors and torch raise their own kinds for a damaged file
            raise _refuse(f"{file} cannot be read ({type(exc).__name__}: {exc}); save the adapter again") from None
    raise _refuse(f"{str(path)!r} has none of {', '.join(WEIGHT_FILES)}")


def read_peft_adapter(path: str | Path, shapes: dict[str, tuple[int, int]], max_rank: int,
                      dtype: torch.dtype) -> PeftAdapter:
    """The adapter at ``path`` for a model whose LoRA modules have these (in, out) ``shapes``
    (lmport.models.lora.LoraLayers.shapes), its B scaled, in ``dtype``; AdapterError for anything else."""
    path = Path(path).expanduser()
    config = read_config(path)
    alpha, rslora = _check_config(config, max_rank)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in _read_tensors(path).items():
        m = _KEY.match(key)
        if m is None:
            raise _refuse(f"tensor {key!r} is not a LoRA A or B weight of a decoder layer's projection; "
                          f"only {', '.join(TARGET_MODULES)} are served")
        module, target, side = m.groups()
        if target not in TARGET_MODULES:
            raise _refuse(f"the adapter targets {target} (tensor {key!r}); target_modules must be among "
                          f"{', '.join(TARGET_MODULES)}")
        if module not in shapes:
            raise _refuse(f"tensor {key!r} names {module}, which the model does not have")
        pairs.setdefault(module, {})[side] = tensor
    if not pairs:
        raise _refuse(f"{str(path)!r} holds no LoRA weights")
    weights, top = {}, 0
    for module, sides in sorted(pairs.items()):
        if set(sides) != {"A", "B"}:
            raise _refuse(f"{module} has lora_{''.join(sides)} but not its pair; save the adapter again")
        a, b = sides["A"], sides["B"]
        n_in, n_out = shapes[module]
        rank = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape != (n_out, rank):
            raise _refuse(f"{module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the model's "
                          f"{n_in} -> {n_out} projection (want [r, {n_in}] and [{n_out}, r]): an adapter of "
                          f"another base model?")
        if rank > max_rank:
            raise _refuse(f"{module} has rank {rank}, above max_lora_rank={max_rank}; restart with a "
                          f"max_lora_rank >= {rank}")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise _refuse(f"{module}: its weights hold NaN or infinite values")
        scaling = alpha / (math.sqrt(rank) if rslora else rank)
        weights[module] = (a.to(dtype), (b.float() * scaling).to(dtype))
        top = max(top, rank)
    return PeftAdapter(str(path), top, weights)
