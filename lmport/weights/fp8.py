"""float8 e4m3 weight checkpoints (docs/weight-quantization.md, "fp8 checkpoints").

A Linear's weight is kept as float8 e4m3fn codes ``q`` [out, in] and a scale per block of
``block_out`` x ``block_in`` weights, so that

    w[n, k] = q[n, k] * scale[n // block_out, k // block_in]

(the product taken in float32, rounded to the scale's own dtype, then to the model's). One layout covers
the three a checkpoint may use (the last block of a row or column may be short):

- per-tensor: one scale, block = the whole weight, scale [1, 1];
- per-channel: a scale per output row, block = 1 x in, scale [out, 1];
- block-scaled: 128 x 128 blocks (DeepSeek-V3/R1, Qwen3-FP8), scale [ceil(out / 128), ceil(in / 128)].

Read from safetensors directories whose config.json ``quantization_config`` is either

- ``quant_method: "fp8"`` (transformers' FineGrainedFP8Config, DeepSeek's own): ``<module>.weight`` float8_e4m3fn
  and ``<module>.weight_scale_inv`` float32, a multiplier despite its name; ``weight_block_size`` [128, 128] makes
  it block-scaled, ``null`` per-tensor; or
- ``quant_method: "compressed-tensors"`` with a float-quantized 8-bit float weight scheme (llm-compressor's FP8,
  FP8_DYNAMIC and FP8_BLOCK): ``<module>.weight`` float8_e4m3fn and ``<module>.weight_scale`` (strategy
  "tensor": [1]; "channel": [out, 1]; "block": [ceil(out / b0), ceil(in / b1)]), dequantized in the scale's
  dtype as compressed-tensors' ``dequantize`` does.

Activation scales (``input_scale``, ``activation_scale``) and KV-cache scales (``k_scale``, ``v_scale``) are read
past: lmport computes with activations in the model's dtype (weight-only fp8, W8A16) and sets its own fp8 KV-cache
scales (quant_policy="fp8").
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from lmport.errors import ConfigError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0   # the largest finite e4m3fn value
# The scale layouts a backend may declare (Capabilities.fp8_weight_scales).
SCALE_LAYOUTS = ("tensor", "channel", "block")
# Tensors a checkpoint may hold beside its fp8 weights that lmport does not use (see the module's docstring).
UNUSED_SCALES = ("input_scale", "activation_scale", "output_scale", "k_scale", "v_scale")


@dataclass(frozen=True)
class Fp8Weight:
    qweight: torch.Tensor   # float8_e4m3fn [out, in]
    scale: torch.Tensor     # [ceil(out / block_out), ceil(in / block_in)], float32, bfloat16 or float16
    block_out: int
    block_in: int

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def layout(self) -> str:
        """"tensor", "channel" or "block" (SCALE_LAYOUTS)."""
        if tuple(self.scale.shape) == (1, 1):
            return "tensor"
        if self.block_out == 1 and self.block_in >= self.in_features:
            return "channel"
        return "block"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scale))

    def row_range(self, start: int, stop: int) -> Fp8Weight:
        """Output rows [start, stop) as views of its tensors (no copy), their scale rows with them: whole row blocks
        (the last may be short where ``stop`` is the last row); ValueError for a range that cuts a block."""
        if start % self.block_out or (stop % self.block_out and stop != self.out_features):
            raise ValueError(f"rows {start}:{stop} of an fp8 weight cut its {self.block_out}-row scale blocks")
        return Fp8Weight(self.qweight[start:stop], self.scale[start // self.block_out:-(-stop // self.block_out)],
                         self.block_out, self.block_in)

    def check(self, name: str = "weight") -> Fp8Weight:
        """Raises ValueError naming ``name`` when the tensors do not form a weight of this format."""
        if self.qweight.dtype != FP8_DTYPE or self.qweight.dim() != 2:
            raise ValueError(f"{name}: fp8 weights must be a 2-d {FP8_DTYPE} tensor, got {self.qweight.dtype} "
                             f"{tuple(self.qweight.shape)}")
        want = (math.ceil(self.out_features / self.block_out), math.ceil(self.in_features / self.block_in))
        if tuple(self.scale.shape) != want or self.scale.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"{name}: a [{self.out_features}, {self.in_features}] weight in blocks of "
                             f"{self.block_out} x {self.block_in} needs a float scale of shape {list(want)}, got "
                             f"{self.scale.dtype} {list(self.scale.shape)}")
        return self


def dequantize(weight: Fp8Weight, dtype: torch.dtype) -> torch.Tensor:
    """The weight in ``dtype`` [out, in]: q * scale in float32, rounded to the scale's dtype, then to ``dtype``
    (compressed-tensors dequantizes in the scale's dtype; transformers' fp8 loader multiplies in float32 with its
    float32 scales: both are this)."""
    scale = weight.scale.float()
    scale = scale.repeat_interleave(weight.block_out, 0)[:weight.out_features]
    scale = scale.repeat_interleave(weight.block_in, 1)[:, :weight.in_features]
    return (weight.qweight.float() * scale).to(weight.scale.dtype).to(dtype)


def fp8_linear(x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The reference op: x @ dequantize(weight)^T (+ bias), in x's dtype."""
    return torch.nn.functional.linear(x, dequantize(weight, x.dtype), bias)


def quantize(w: torch.Tensor, block_out: int, block_in: int,
             scale_dtype: torch.dtype = torch.float32) -> Fp8Weight:
    """``w`` [out, in] as fp8 codes with a scale per block: amax(|block|) / 448 (1 for an all-zero block),
    codes = w / scale rounded to nearest even, as llm-compressor and DeepSeek's quantizers make them."""
    n, k = w.shape
    rows, cols = math.ceil(n / block_out), math.ceil(k / block_in)
    padded = torch.zeros(rows * block_out, cols * block_in, dtype=torch.float32)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(rows, block_out, cols, block_in)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).to(scale_dtype)
    codes = (blocks / scale.float()[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes.reshape(rows * block_out, cols * block_in)[:n, :k].contiguous(), scale, block_out, block_in)


# -- checkpoints ---------------------------------------------------------------


@dataclass(frozen=True)
class Fp8Checkpoint:
    """What a checkpoint's quantization_config says about its fp8 weights."""
    method: str                         # "fp8" or "compressed-tensors"
    layouts: frozenset[str]             # of SCALE_LAYOUTS
    block: tuple[int, int] | None       # block-scaled: (rows, inputs) of a block
    scale_name: str                     # "weight_scale_inv" or "weight_scale"

    def describe(self) -> str:
        block = f" {self.block[0]}x{self.block[1]}" if self.block else ""
        return f"float8 e4m3 weights, {'/'.join(sorted(self.layouts))}{block} scales ({self.method})"


def read_checkpoint(directory: Path) -> Fp8Checkpoint | None:
    """The fp8 weight scheme of a transformers directory, None when it has none; ConfigError for an fp8
    quantization_config lmport cannot load (naming what, and what it loads). Reads config.json only."""
    config_file = directory / "config.json"
    if not config_file.exists():
        return None
    q = json.loads(config_file.read_text()).get("quantization_config")
    return from_quantization_config(q, f"{config_file} quantization_config")


def from_quantization_config(q, where: str) -> Fp8Checkpoint | None:
    """The fp8 weight scheme of a ``quantization_config`` (``where``: where it was read, for errors); None when it is
    not one."""
    if not isinstance(q, dict):
        return None
    if q.get("quant_method") == "fp8":
        return _fine_grained(q, where)
    if q.get("quant_method") == "compressed-tensors":
        return _compressed_tensors(q, where)
    return None


def _fine_grained(q: dict, where: str) -> Fp8Checkpoint:
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"{where}: fmt {q.get('fmt')!r} is not supported (supported: e4m3)")
    if q.get("scale_fmt", "float") != "float":
        raise ConfigError(f"{where}: scale_fmt {q.get('scale_fmt')!r} (power-of-two scales in bytes) is not "
                          f"supported (supported: float)")
    if q.get("expert_dtype", "fp8") != "fp8":
        raise ConfigError(f"{where}: expert_dtype {q.get('expert_dtype')!r} is not supported (supported: fp8)")
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Checkpoint("fp8", frozenset({"tensor"}), None, "weight_scale_inv")
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{where}: weight_block_size {block!r} is not two positive ints")
    return Fp8Checkpoint("fp8", frozenset({"block"}), (block[0], block[1]), "weight_scale_inv")


def _compressed_tensors(q: dict, where: str) -> Fp8Checkpoint:
    groups = q.get("config_groups") or {}
    if not groups:
        raise ConfigError(f"{where}: compressed-tensors without config_groups is not supported")
    layouts, block = set(), None
    for name, group in groups.items():
        fmt = group.get("format") or q.get("format")
        w = group.get("weights") or {}
        scheme = (f"num_bits={w.get('num_bits')}, type={w.get('type')!r}, strategy={w.get('strategy')!r}, "
                  f"format={fmt!r}")
        if (w.get("num_bits") != 8 or w.get("type") != "float" or fmt not in ("float-quantized", "naive-quantized")
                or w.get("strategy") not in SCALE_LAYOUTS or w.get("dynamic") or not w.get("symmetric", True)):
            raise ConfigError(f"{where}: config group {name!r} ({scheme}) is not an fp8 weight scheme lmport loads "
                              f"(supported: num_bits=8, type='float', symmetric, static weight scales, strategy "
                              f"'tensor', 'channel' or 'block', format 'float-quantized')")
        layouts.add(w["strategy"])
        if w["strategy"] == "block":
            structure = w.get("block_structure")
            if not (isinstance(structure, list) and len(structure) == 2):
                raise ConfigError(f"{where}: config group {name!r} has strategy 'block' but block_structure "
                                  f"{structure!r}, not [rows, inputs]")
            if block is not None and tuple(structure) != block:
                raise ConfigError(f"{where}: config groups with different block_structure ({list(block)} and "
                                  f"{structure}) are not supported")
            block = (int(structure[0]), int(structure[1]))
    return Fp8Checkpoint("compressed-tensors", frozenset(layouts), block, "weight_scale")


def check_backend(checkpoint: Fp8Checkpoint, directory: Path, caps, backends_running) -> None:
    """ConfigError when ``caps`` cannot run the checkpoint's fp8 weights, naming the backends that can and the
    option that dequantizes them at load instead. A model's routed experts are run as its linears are (each
    expert's rows through ``Backend.fp8_linear``), so they need nothing more."""
    missing = sorted(checkpoint.layouts - caps.fp8_weight_scales)
    if not missing:
        return
    runs = (f"it runs fp8 weights with {', '.join(sorted(caps.fp8_weight_scales))} scales"
            if caps.fp8_weight_scales else "its Capabilities.fp8_weight_scales declares no fp8 weights")
    where = ", ".join(backends_running(lambda c: checkpoint.layouts <= c.fp8_weight_scales))
    raise ConfigError(
        f"{directory.name} holds {checkpoint.describe()}, which device {caps.device_type!r} cannot run ({runs}); "
        f"backends that run them: {where}. Use one of those, or weight_format='dequantize' (--weight-format "
        f"dequantize) to dequantize them to the model's dtype at load (twice the weight memory of fp8 at 16 bits)")


EXPERT_WEIGHT = re.compile(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# config.json keys that give a model routed experts (Qwen3-MoE / Mixtral / DeepSeek-V3 spellings)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")


def stack_experts(floats: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``floats`` with a mixture-of-experts block's per-expert weights, as fp8 checkpoints store them
    ("<block>.experts.<e>.gate_proj.weight", ...), stacked as lmport's experts hold them (lmport.models.moe):
    "<block>.experts.gate_up_proj" [experts, 2 * inter, hidden] (each expert's gate rows, then its up rows) and
    "<block>.experts.down_proj" [experts, hidden, inter]."""
    out, blocks = _experts_by_block(floats, lambda t: True)
    for block, experts in blocks.items():
        out[f"{block}.gate_up_proj"] = torch.stack([torch.cat([e["gate_proj"], e["up_proj"]]) for e in experts])
        out[f"{block}.down_proj"] = torch.stack([e["down_proj"] for e in experts])
    return out


def stack_quantized_experts(quantized: dict) -> dict:
    """``quantized`` with a mixture-of-experts block's per-expert fp8 weights ("<block>.experts.<e>.gate_proj.weight",
    ...) stacked as the experts' quantized holder takes them (lmport.models.quantized.QuantExperts): one Fp8Weight
    each for "<block>.experts.gate_proj", "up_proj" and "down_proj", [experts x rows, inputs], the experts' codes and
    scale rows in turn, so that an expert's rows are whole scale blocks (``Fp8Weight.row_range``). Other weights
    (and experts of other kinds) pass through."""
    out, blocks = _experts_by_block(quantized, lambda w: isinstance(w, Fp8Weight))
    for block, experts in blocks.items():
        for part in ("gate_proj", "up_proj", "down_proj"):
            out[f"{block}.{part}"] = _stacked([e[part] for e in experts], f"{block}.{part}")
    return out


def _experts_by_block(weights: dict, select) -> tuple[dict, dict[str, list[dict]]]:
    """(the weights that are not a routed expert's, or that ``select`` leaves out; each block's experts in order,
    an expert's gate_proj, up_proj and down_proj by name). ValueError where a block's experts are not numbered
    from 0 or one lacks a part."""
    others, blocks = {}, {}
    for name, w in weights.items():
        m = EXPERT_WEIGHT.fullmatch(name)
        if m is None or not select(w):
            others[name] = w
        else:
            blocks.setdefault(m[1], {}).setdefault(int(m[2]), {})[m[3]] = w
    for block, experts in blocks.items():
        if sorted(experts) != list(range(len(experts))) or any(len(e) != 3 for e in experts.values()):
            raise ValueError(f"{block}: experts {sorted(experts)} must be numbered from 0 and each have gate_proj, "
                             f"up_proj and down_proj weights (in fp8 where any is)")
    return others, {block: [experts[e] for e in range(len(experts))] for block, experts in blocks.items()}


def _stacked(weights: list[Fp8Weight], name: str) -> Fp8Weight:
    """The experts' weights of one projection as one, each expert's rows a whole number of scale blocks: its
    blocks' rows, or, where an expert's rows fit one block, that block (a per-tensor scale, a short block)."""
    first = weights[0]
    kind = (tuple(first.qweight.shape), tuple(first.scale.shape), first.scale.dtype, first.block_out, first.block_in)
    if any((tuple(w.qweight.shape), tuple(w.scale.shape), w.scale.dtype, w.block_out, w.block_in) != kind
           for w in weights):
        raise ValueError(f"{name}: the experts' fp8 weights differ in shape, scale layout or scale dtype")
    rows = first.out_features
    if rows % first.block_out == 0:
        block_out = first.block_out
    elif first.scale.shape[0] == 1:
        block_out = rows
    else:
        raise ValueError(f"{name}: an expert's {rows} rows end inside a {first.block_out}-row scale block, so the "
                         f"experts cannot be held stacked in fp8; use weight_format='dequantize'")
    return Fp8Weight(torch.cat([w.qweight for w in weights]), torch.cat([w.scale for w in weights]), block_out,
                     first.block_in).check(name)


def scale_count(checkpoint: Fp8Checkpoint, rows: int, inputs: int) -> int:
    """Scales beside a [rows, inputs] weight of the checkpoint: a block's each where it names a block size, else a
    row's each (per-channel) or one (per-tensor)."""
    if checkpoint.block is not None:
        return math.ceil(rows / checkpoint.block[0]) * math.ceil(inputs / checkpoint.block[1])
    return rows if "channel" in checkpoint.layouts else 1


def _cut(start: int, stop: int, block: int, size: int) -> tuple[int, int, int] | None:
    """[start, stop) of a dimension of ``size`` in blocks of ``block``, as (first block, end block, block size of
    the piece): whole blocks (the last may be short at ``size``), or a piece inside one block, which keeps that
    block's scale; None where the range cuts blocks otherwise."""
    if start % block == 0 and (stop % block == 0 or stop == size):
        return start // block, -(-stop // block), block
    if start // block == (stop - 1) // block:
        return start // block, start // block + 1, stop - start
    return None


def expert_split_problem(checkpoint: Fp8Checkpoint, inter: int, tp: int) -> str | None:
    """Why ``tp`` equal slices of every routed expert's ``inter`` intermediate rows (gate and up by their rows, down by
    its inputs: lmport.models.moe) cannot be cut from the checkpoint's fp8 experts in whole scale blocks; None where
    they can."""
    if tp == 1:
        return None
    rows, inputs = checkpoint.block or ((1 if "channel" in checkpoint.layouts else inter), inter)
    piece = inter // tp
    if all(_cut(r * piece, (r + 1) * piece, b, inter) for r in range(tp) for b in (rows, inputs)):
        return None
    return (f"each of tp={tp} ranks would hold {piece} of every routed expert's {inter} intermediate rows, which cuts "
            f"the fp8 experts' {rows} x {inputs} scale blocks")


def expert_slice(weight: Fp8Weight, num_experts: int, start: int, stop: int, by_inputs: bool) -> Fp8Weight:
    """Stacked fp8 experts (``stack_quantized_experts``) cut to each expert's rows [start, stop) (gate, up), or to
    every row's inputs [start, stop) (down), with their scales: a copy. ValueError where the range cuts scale
    blocks (``expert_split_problem`` says so before any weight loads)."""
    if by_inputs:
        cut = _cut(start, stop, weight.block_in, weight.in_features)
        if cut is None:
            raise ValueError(f"inputs {start}:{stop} cut the fp8 experts' {weight.block_in}-input scale blocks")
        return Fp8Weight(weight.qweight[:, start:stop].contiguous(), weight.scale[:, cut[0]:cut[1]].contiguous(),
                         weight.block_out, cut[2])
    rows = weight.out_features // num_experts
    cut = _cut(start, stop, weight.block_out, rows)
    if cut is None:
        raise ValueError(f"rows {start}:{stop} of each expert cut the fp8 experts' {weight.block_out}-row scale blocks")
    blocks = -(-rows // weight.block_out)   # an expert's scale rows
    codes = weight.qweight.unflatten(0, (num_experts, rows))[:, start:stop].flatten(0, 1).contiguous()
    scale = weight.scale.unflatten(0, (num_experts, blocks))[:, cut[0]:cut[1]].flatten(0, 1).contiguous()
    return Fp8Weight(codes, scale, cut[2], weight.block_in).check()


def load_tensors(directory: Path, checkpoint: Fp8Checkpoint,
                 dtype: torch.dtype) -> tuple[dict[str, Fp8Weight], dict[str, torch.Tensor]]:
    """(fp8 weights by transformers' weight name, float tensors in ``dtype``) of an fp8 safetensors directory. A
    model with routed experts keeps its experts' weights (one by one, as stored: ``stack_quantized_experts`` stacks
    them) in fp8, the bulk of its bytes, and has its other fp8 weights dequantized to ``dtype`` among the floats,
    which the model may turn at load and tensor parallelism shards."""
    from safetensors import safe_open
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}
    if not tensors:
        raise ValueError(f"{directory}: no *.safetensors files")
    quantized, floats = {}, {}
    used = set()
    for name, t in tensors.items():
        if t.dtype != FP8_DTYPE:
            continue
        if not name.endswith(".weight"):
            raise ValueError(f"{directory.name}: {name} is {FP8_DTYPE}, but only a module's weight may be")
        scale_name = f"{name.removesuffix('.weight')}.{checkpoint.scale_name}"
        if scale_name not in tensors:
            raise ValueError(f"{directory.name}: {name} is {FP8_DTYPE} but has no {scale_name} "
                             f"({checkpoint.method} checkpoints keep one beside each fp8 weight)")
        quantized[name] = _weight(name, t, tensors[scale_name], checkpoint)
        used |= {name, scale_name}
    if not quantized:
        raise ValueError(f"{directory.name}: its quantization_config says fp8, but no tensor is {FP8_DTYPE}")
    for name, t in tensors.items():
        if name in used or name.rpartition(".")[2] in UNUSED_SCALES:
            continue
        if name.endswith(f".{checkpoint.scale_name}"):
            raise ValueError(f"{directory.name}: {name} has no fp8 weight beside it")
        floats[name] = t.to(dtype) if t.is_floating_point() else t
    if routed_experts(directory):
        dense = {name: w for name, w in quantized.items() if EXPERT_WEIGHT.fullmatch(name) is None}
        floats |= {name: dequantize(w, dtype) for name, w in dense.items()}
        quantized = {name: w for name, w in quantized.items() if name not in dense}
    return quantized, floats


def routed_experts(directory: Path) -> int:
    """The routed experts a transformers directory's config.json gives its model (0: none)."""
    config = json.loads((directory / "config.json").read_text())
    return next((int(config[k]) for k in EXPERT_COUNTS if config.get(k)), 0)


def _weight(name: str, q: torch.Tensor, scale: torch.Tensor, checkpoint: Fp8Checkpoint) -> Fp8Weight:
    """An fp8 weight from its codes and its scale as the checkpoint stores it, its layout told by the scale's
    shape (per-tensor: one value; per-channel: [out, 1]; block-scaled: the config's block grid)."""
    n, k = q.shape
    if scale.numel() == 1:
        return Fp8Weight(q, scale.reshape(1, 1), n, k).check(name)
    if "channel" in checkpoint.layouts and tuple(scale.shape) == (n, 1):
        return Fp8Weight(q, scale, 1, k).check(name)
    if checkpoint.block is None:
        raise ValueError(f"{name}: a [{n}, {k}] fp8 weight with a scale of shape {list(scale.shape)}: neither one "
                         f"value (per-tensor) nor [{n}, 1] (per-channel), and the config names no block size")
    return Fp8Weight(q, scale, *checkpoint.block).check(name)
