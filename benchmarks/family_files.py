"""Random-weight GGUF files of about 1B parameters in each newer family lmport runs, made as llama.cpp's users make
theirs: a transformers checkpoint (bf16 safetensors) through llama.cpp's own ``convert_hf_to_gguf.py --outtype
f16``, then ``llama-quantize F16 OUT TYPE``. For the CPU decode benchmarks against llama.cpp
(benchmarks/single_stream.py ``--files PATH``).

Each model is built from transformers' own config class with seeded random weights (transformers' initializer,
std 0.02). Shapes: cut from a released config to about 1B parameters, keeping its head dims and head counts, its
layer pattern (whole periods of it) and top-k; the expert count, and the hidden width of the families wider than
2048, cut to fit. The vocabulary has the released model's size: the default model's tokenizer (SmolLM2's 49,152
tokens, the one tokenizer every converter path here takes offline) padded by the converter with ``[PAD<id>]``
tokens to the real embedding rows, so the output projection a decode step reads is the real one's.

- smollm3-1b, from SmolLM3-3B: 12 of 36 layers (every 4th NoPE), hidden 2048, 16 heads x 128 with 4 kv heads,
  MLP 11008, vocabulary 128256 tied; 1.20B parameters.
- qwen3-next-1b, from Qwen3-Next-80B-A3B: 8 of 48 layers (3 linear, 1 full, twice), hidden 2048; full attention
  16 heads x 256 with 2 kv heads and the output gate; Gated DeltaNet 16 key / 32 value heads x 128; 32 of 512
  experts x 512, top 10, a shared expert of 512 on every layer; vocabulary 151936; 1.71B.
- qwen3.5-1b, from Qwen3.5-27B (dense): 8 layers (3 linear, 1 full, twice), hidden 2048; full attention 8 heads x
  256 with 2 kv heads; Gated DeltaNet as Qwen3-Next's; MLP 6144; vocabulary 248320; 1.55B.
- deepseek-v3-1b, from DeepSeek-V3: 6 of 61 layers (the first dense, 5632), hidden 2048 of 7168; MLA with 16
  heads, q_lora 1536, kv_lora 512, nope 128, rope 64, v 128 (the real head dims and ranks); 32 of 256 experts x 512,
  top 8 in 8 groups (the best 4), one shared expert, sigmoid routing with its score bias; vocabulary 129280; 1.18B.
- gpt-oss-1b, from gpt-oss-20b: 6 of 24 layers (128-token sliding and full alternating), hidden 1536 of 2880; 24
  heads x 64 with 4 kv heads and sinks; 16 of 32 experts x 1536, top 4; vocabulary 201088; 1.33B.
- llama4-1b, from Llama 4 Maverick: 8 of 48 layers (every 4th NoPE, experts on every 2nd, the others a dense MLP of
  4096), hidden 2048 of 5120; 16 heads x 128 with 4 kv heads, q/k L2 norms; 16 experts x 1024, top 1, a shared
  expert; vocabulary 202048; 1.44B.
- glm4.5-1b, from GLM-4.5-Air: 6 of 46 layers (the first dense, 5632), hidden 2048 of 4096; 32 heads x 128 with 4 kv
  heads, half the head rotary, q/k/v biases; 32 of 128 experts x 512, top 8, one shared; vocabulary 151552; 1.29B.

Types: Q4_K_M for every family; gpt-oss also MXFP4_MOE (its experts MXFP4 and the rest Q8_0, as the released
gpt-oss GGUFs are; from a bf16 checkpoint the converter writes the experts in F16 and llama-quantize makes them
MXFP4). Widths are multiples of 256, so K-quants apply to every matrix llama.cpp's preset gives them to.

A file is named ``FAMILY-1b-TYPE.gguf`` and made once into the files directory; the checkpoint and the F16 file
are deleted after. ``--check`` loads each file in lmport and in llama.cpp (``llama-server``) and prints a short
greedy generation of each.

Run: python benchmarks/family_files.py [qwen3-next-1b-Q4_K_M ...] [--check] [--files-dir DIR]
(no names: every family's default file)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_DIR = Path.home() / ".cache" / "lmport-files"
DEFAULT_LLAMA_BIN = Path(os.environ.get("LMPORT_LLAMA_CPP_BIN", Path.home() / ".cache" / "llamacpp" / "build" / "bin"))
DEFAULT_CONVERTER = Path(os.environ.get(
    "LMPORT_LLAMA_CPP_CONVERTER",
    Path.home() / ".cache" / "llamacpp" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"))
# Where the converter's own requirements (sentencepiece) are installed, when not in this environment.
DEFAULT_CONVERTER_DEPS = Path(os.environ.get("LMPORT_LLAMA_CPP_PYDEPS", Path.home() / ".cache" / "llamacpp" / "pydeps"))

_MODEL = dict(max_position_embeddings=8192, bos_token_id=1, eos_token_id=2, rms_norm_eps=1e-6)
# The released layer pattern of the hybrid families: three linear-attention layers, then a full one.
_HYBRID_8 = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(8)]
_QWEN_LINEAR = dict(linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
                    linear_num_key_heads=16, linear_num_value_heads=32)


@dataclass(frozen=True)
class Family:
    config_class: str                  # transformers' config class
    fields: dict                       # its fields (the shapes of the table above)
    types: tuple[str, ...] = ("Q4_K_M",)
    converter_flags: tuple[str, ...] = ()
    # keys of a released config.json that its transformers config class drops on saving, put back for the converter
    released_keys: dict = field(default_factory=dict)
    # tokens of the default tokenizer renamed to the special tokens the family's converter looks up (same ids)
    renamed_tokens: dict = field(default_factory=dict)


FAMILIES = {
    "smollm3-1b": Family("SmolLM3Config", dict(
        _MODEL, vocab_size=128256, hidden_size=2048, intermediate_size=11008, num_hidden_layers=12,
        num_attention_heads=16, num_key_value_heads=4, no_rope_layer_interval=4, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000000.0}, pad_token_id=0)),
    "qwen3-next-1b": Family("Qwen3NextConfig", dict(
        _MODEL, **_QWEN_LINEAR, vocab_size=151936, hidden_size=2048, intermediate_size=5120, num_hidden_layers=8,
        layer_types=_HYBRID_8, num_attention_heads=16, num_key_value_heads=2, head_dim=256, num_experts=32,
        num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512, norm_topk_prob=True,
        mlp_only_layers=[], tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}),
        converter_flags=("--no-mtp",)),
    "qwen3.5-1b": Family("Qwen3_5TextConfig", dict(
        _MODEL, **_QWEN_LINEAR, vocab_size=248320, hidden_size=2048, intermediate_size=6144, num_hidden_layers=8,
        layer_types=_HYBRID_8, num_attention_heads=8, num_key_value_heads=2, head_dim=256, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True}),
        converter_flags=("--no-mtp",)),
    "deepseek-v3-1b": Family("DeepseekV3Config", dict(
        _MODEL | {"max_position_embeddings": 163840}, vocab_size=129280, hidden_size=2048, intermediate_size=5632,
        moe_intermediate_size=512, num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=16,
        num_key_value_heads=16,
        n_routed_experts=32, num_experts_per_tok=8, n_group=8, topk_group=4, n_shared_experts=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, rope_interleave=True, attention_bias=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                         "original_max_position_embeddings": 4096}),
        # without them the converter writes no gating function, which llama.cpp reads as DeepSeek-V2's softmax
        released_keys={"scoring_func": "sigmoid", "topk_method": "noaux_tc"}),
    "gpt-oss-1b": Family("GptOssConfig", dict(
        _MODEL | {"max_position_embeddings": 131072}, vocab_size=201088, hidden_size=1536, intermediate_size=1536,
        num_hidden_layers=6, num_attention_heads=24, num_key_value_heads=4, head_dim=64, num_local_experts=16,
        num_experts_per_tok=4,
        sliding_window=128, attention_bias=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}),
        types=("MXFP4_MOE", "Q4_K_M")),
    "llama4-1b": Family("Llama4TextConfig", dict(
        _MODEL, vocab_size=202048, hidden_size=2048, intermediate_size=1024, intermediate_size_mlp=4096,
        num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_local_experts=16,
        num_experts_per_tok=1, interleave_moe_layer_step=2, attention_chunk_size=8192, floor_scale=8192,
        attn_scale=0.1, use_qk_norm=True, tie_word_embeddings=False, pad_token_id=0,
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0})),
    "glm4.5-1b": Family("Glm4MoeConfig", dict(
        _MODEL, vocab_size=151552, hidden_size=2048, intermediate_size=5632, moe_intermediate_size=512,
        num_hidden_layers=6, first_k_dense_replace=1, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        n_routed_experts=32, num_experts_per_tok=8, n_group=1, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=1.0, norm_topk_prob=True, use_qk_norm=False, attention_bias=True,
        num_nextn_predict_layers=0, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "partial_rotary_factor": 0.5}),
        # the converter reads GLM's vocabulary by these special tokens
        renamed_tokens={"<repo_name>": "[gMASK]", "<reponame>": "<|user|>", "<file_sep>": "<|observation|>"}),
}
NAMES = tuple(f"{family}-{kind}" for family, spec in FAMILIES.items() for kind in spec.types)
DEFAULT_NAMES = tuple(f"{family}-{spec.types[0]}" for family, spec in FAMILIES.items())

# The converter loads the tokenizer with transformers' AutoTokenizer, which gives a qwen3_5_text directory
# transformers' Qwen3.5 tokenizer class whatever its tokenizer_config says; over the default tokenizer's vocabulary
# that class's pre-tokenizer is none the converter knows. Run so, the converter takes the directory's own tokenizer,
# as it does for a released Qwen3.5 (whose tokenizer it knows).
_CONVERT_WITH_OWN_TOKENIZER = """
import os, runpy, sys
from transformers.models.auto import tokenization_auto as auto
for model_type in ("qwen3_5_text", "qwen3_5_moe_text"):
    auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS.discard(model_type)
    auto.TOKENIZER_MAPPING_NAMES[model_type] = "TokenizersBackend"
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(sys.argv[0]))   # as running the script puts its directory first
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def split_name(name: str) -> tuple[str, str]:
    """``FAMILY-TYPE`` as (family, type); a clear error for anything else."""
    for family, spec in FAMILIES.items():
        kind = name.removeprefix(f"{family}-")
        if kind != name and kind in spec.types:
            return family, kind
    raise SystemExit(f"unknown family file {name!r}: one of {', '.join(NAMES)}")


def build_checkpoint(family: str, out: Path, seed: int = 0) -> int:
    """The family's random-weight model saved into ``out`` as a bf16 transformers directory with the default
    tokenizer (and the family's tweaks, see Family); returns its parameter count."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    from lmport.models.loader import load_tokenizer
    spec = FAMILIES[family]
    config = getattr(transformers, spec.config_class)(**spec.fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(out)
    del model
    load_tokenizer("smollm2").save_pretrained(out)
    if spec.released_keys:
        cfg_path = out / "config.json"
        cfg_path.write_text(json.dumps(json.loads(cfg_path.read_text()) | spec.released_keys, indent=2))
    if spec.renamed_tokens:
        tok_path = out / "tokenizer.json"
        tokenizer = json.loads(tok_path.read_text())
        for token in tokenizer["added_tokens"]:
            token["content"] = spec.renamed_tokens.get(token["content"], token["content"])
        vocab = tokenizer["model"]["vocab"]
        for old, new in spec.renamed_tokens.items():
            vocab[new] = vocab.pop(old)
        tok_path.write_text(json.dumps(tokenizer))
    return params


def convert(source: Path, out: Path, flags: tuple[str, ...], converter: Path, deps: Path) -> None:
    """llama.cpp's ``convert_hf_to_gguf.py SOURCE --outtype f16``, run with this environment's python."""
    if not converter.exists():
        raise SystemExit(f"no llama.cpp converter at {converter}: pass --converter (convert_hf_to_gguf.py in "
                         "llama.cpp's source)")
    env = dict(os.environ)
    if deps.is_dir():
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(deps), env.get("PYTHONPATH")]))
    argv = [sys.executable, "-c", _CONVERT_WITH_OWN_TOKENIZER, str(converter), str(source), "--outtype", "f16",
            "--outfile", str(out), "--model-name", f"{source.name} (random weights)", *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed on {source}:\n{proc.stderr[-3000:]}")


def family_file(name: str, files_dir: Path = DEFAULT_DIR, llama_bin: Path = DEFAULT_LLAMA_BIN,
                converter: Path = DEFAULT_CONVERTER, deps: Path = DEFAULT_CONVERTER_DEPS) -> Path:
    """``files_dir/NAME.gguf``, made when missing: checkpoint, F16 file, llama-quantize; the first two deleted."""
    family, kind = split_name(name)
    target = files_dir / f"{name}.gguf"
    if target.exists():
        return target
    quantize = llama_bin / "llama-quantize"
    if not quantize.exists():
        raise SystemExit(f"{target} is missing and there is no {quantize} to make it with: pass --llama-bin")
    files_dir.mkdir(parents=True, exist_ok=True)
    source, f16 = files_dir / f"{family}-hf.partial", files_dir / f"{family}-F16.partial.gguf"
    shutil.rmtree(source, ignore_errors=True)
    try:
        t0 = time.perf_counter()
        params = build_checkpoint(family, source)
        t1 = time.perf_counter()
        convert(source, f16, FAMILIES[family].converter_flags, converter, deps)
        shutil.rmtree(source)
        t2 = time.perf_counter()
        partial = target.with_name(f"{target.stem}.partial.gguf")
        proc = subprocess.run([str(quantize), str(f16), str(partial), kind], capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"llama-quantize failed on {f16}:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
        partial.rename(target)
        print(f"{name}: {params / 1e9:.2f}B parameters, {target.stat().st_size / 1e9:.2f} GB; built in "
              f"{t1 - t0:.0f} s, converted in {t2 - t1:.0f} s, quantized in {time.perf_counter() - t2:.0f} s",
              file=sys.stderr)
    finally:
        shutil.rmtree(source, ignore_errors=True)
        f16.unlink(missing_ok=True)
    return target


# ---- the check: each file generates in lmport and in llama.cpp ----

PROMPT = "The capital of France is"


def lmport_tokens(path: Path, new_tokens: int, threads: int) -> tuple[list[int], list[int]]:
    """(prompt ids, lmport's greedy tokens) for PROMPT, the weights as the file holds them."""
    import torch

    import lmport
    torch.set_num_threads(threads)
    cfg = lmport.EngineConfig(device_type="cpu", cache_max_entry_count=64)
    with lmport.pipeline(str(path), backend_config=cfg) as pipe:
        ids = pipe.tokenizer.encode(PROMPT)
        out = pipe.generate([ids], lmport.GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True))[0]
    if out.error:
        raise SystemExit(f"lmport failed on {path.name}: {out.error}")
    return ids, out.token_ids


def llama_tokens(path: Path, ids: list[int], new_tokens: int, llama_bin: Path, threads: int) -> list[int]:
    """llama.cpp's greedy tokens after ``ids`` (llama-server's /completion, temperature 0)."""
    server = llama_bin / "llama-server"
    if not server.exists():
        raise SystemExit(f"no llama-server in {llama_bin}: pass --llama-bin")
    from lmport.bench.client import LLAMA_SERVING, served_url
    log = path.with_suffix(".llama-server.log")
    with log.open("w") as out:   # port 0: the server binds a free port and prints it
        proc = subprocess.Popen([str(server), "-m", str(path), "--host", "127.0.0.1", "--port", "0",
                                 "-t", str(threads), "-c", "512", "-np", "1"],
                                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        url = served_url(proc, log, deadline, LLAMA_SERVING)
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"llama-server exited {proc.returncode} on {path.name}:\n{log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not load {path.name} in 300 s:\n{log.read_text()[-3000:]}")
            time.sleep(1)
        body = json.dumps({"prompt": ids, "n_predict": new_tokens, "temperature": 0, "top_k": 1,
                           "ignore_eos": True, "cache_prompt": False, "return_tokens": True}).encode()
        req = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())["tokens"]
    finally:
        proc.terminate()
        proc.wait(30)
        log.unlink(missing_ok=True)


def check(path: Path, llama_bin: Path, threads: int, new_tokens: int = 8) -> None:
    ids, ours = lmport_tokens(path, new_tokens, threads)
    theirs = llama_tokens(path, ids, new_tokens, llama_bin, threads)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    print(f"{path.name}: lmport {ours}; llama.cpp {theirs}; first {same} identical")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar="FAMILY-TYPE", help=", ".join(NAMES))
    ap.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN, help="a llama.cpp build's bin directory")
    ap.add_argument("--converter", type=Path, default=DEFAULT_CONVERTER, help="llama.cpp's convert_hf_to_gguf.py")
    ap.add_argument("--converter-deps", type=Path, default=DEFAULT_CONVERTER_DEPS,
                    help="a directory put on the converter's PYTHONPATH (its requirements, e.g. sentencepiece)")
    ap.add_argument("--check", action="store_true", help="a short greedy generation of each file in both engines")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    names = args.names or list(DEFAULT_NAMES)
    for name in names:
        split_name(name)   # every name refused before anything is built
    for name in names:
        path = family_file(name, args.files_dir, args.llama_bin, args.converter, args.converter_deps)
        print(path, flush=True)
        if args.check:
            check(path, args.llama_bin, args.threads)


if __name__ == "__main__":
    main()
