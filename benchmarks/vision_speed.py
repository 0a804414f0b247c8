"""Images through the vision encoder and time to first token of a one-image chat on the cpu backend: lmport against
llama.cpp's ``llama-server --mmproj`` on the same GGUF pair, in one run.

The pair: a Qwen2.5-VL in the shape of Qwen2.5-VL-3B-Instruct (its text model's layers, widths, heads and
vocabulary size, tied output; its vision tower's 32 blocks of 1280, window attention with full attention in blocks
7, 15, 23 and 31, the 2 x 2 merger to the text's width), random weights, written as llama.cpp's converter writes
one: a ``qwen2vl`` text GGUF (F16, then ``llama-quantize`` to --text-type, default Q4_K_M) and a ``qwen2.5vl_merger``
mmproj (F16). The vocabulary is llama.cpp's Qwen2 one (``models/ggml-vocab-qwen2.gguf``) with Qwen2.5-VL's vision
tokens at their ids. Made once into --files-dir (default ~/.cache/lmport-files); ``--shape small`` makes a small
pair of the same layout to check the script quickly.

Per round, each engine in turn (so a load from elsewhere falls on both alike), --rounds rounds (default 5), a fresh
448 x 448 image each time (16 x 16 = 256 image tokens; a size neither processor resizes; a new image so no cache
answers):

- encoder: one image through the vision tower and merger, lmport's tower call (``run_tower``). llama-server neither
  logs nor returns its encoder's time (its mtmd helper's ``image slice encoded`` line is not printed by the server,
  and this build has no ``llama-mtmd-cli``): its row gives the ``prompt_ms`` its reply reports instead (the image
  encoded and the whole prompt's prefill), beside lmport's time to first token.
- time to first token: a chat of the image and a short question, one token generated. lmport: in process, from
  ``add_request`` to the first token; llama.cpp: ``/completion`` with ``n_predict`` 1 and the image in
  ``multimodal_data``, from the request to the reply (its HTTP round trip included).

The table gives the median and the min-max of the rounds, with the CPU and the threads of both engines (--threads,
default all the cores this process may use).

Run: python benchmarks/vision_speed.py [--shape qwen2.5-vl-3b] [--rounds 5] [--threads N] [--llama-bin DIR]
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sized_files import DEFAULT_DIR, DEFAULT_LLAMA_BIN, tokenizer_fields  # noqa: E402

# llama.cpp's source (its models/ holds the vocabulary): LMPORT_LLAMA_CPP_SRC, else the one llama-cpp-python vendors
_VENDORED = sorted((Path.home() / ".cache" / "llamacpp").glob("llama_cpp_python-*/vendor/llama.cpp"))
LLAMA_SRC = Path(os.environ.get("LMPORT_LLAMA_CPP_SRC") or (_VENDORED[-1] if _VENDORED else
                                                            Path.home() / ".cache" / "llamacpp" / "src"))
# Qwen2.5-VL's vision tokens and their ids in its vocabulary
VISION_TOKENS = {151652: "<|vision_start|>", 151653: "<|vision_end|>", 151654: "<|vision_pad|>",
                 151655: "<|image_pad|>", 151656: "<|video_pad|>"}
# Qwen2.5-VL's chat template, its tool and video branches left out
TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a "
    "helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}{% if content['type'] == "
    "'image' or 'image_url' in content %}<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}"
    "{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}"
    "<|im_start|>assistant\n{% endif %}")
IMAGE_SIDE = 448
QUESTION = "What is in this image?"


@dataclass(frozen=True)
class Shape:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    sections: tuple[int, int, int]   # the multimodal rotary's sections (of head_dim / 2)
    vision_depth: int
    vision_hidden: int
    vision_ffn: int
    vision_heads: int
    full_attention_every: int        # n_wa_pattern: blocks 7, 15, ... attend over the whole image


SHAPES = {"qwen2.5-vl-3b": Shape(36, 2048, 11008, 16, 2, (16, 24, 24), 32, 1280, 3420, 16, 8),
          "small": Shape(2, 256, 512, 4, 2, (8, 12, 12), 4, 128, 256, 2, 2)}
N_VOCAB, PATCH, ROPE_THETA, EPS = 151936, 14, 1000000.0, 1e-6


def text_tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    head = s.hidden // s.heads
    out = [("token_embd.weight", (N_VOCAB, s.hidden)), ("output_norm.weight", (s.hidden,))]
    for i in range(s.layers):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (s.hidden,)), (b + "attn_q.weight", (s.hidden, s.hidden)),
                (b + "attn_q.bias", (s.hidden,)), (b + "attn_k.weight", (s.kv_heads * head, s.hidden)),
                (b + "attn_k.bias", (s.kv_heads * head,)), (b + "attn_v.weight", (s.kv_heads * head, s.hidden)),
                (b + "attn_v.bias", (s.kv_heads * head,)), (b + "attn_output.weight", (s.hidden, s.hidden)),
                (b + "ffn_norm.weight", (s.hidden,)), (b + "ffn_gate.weight", (s.ffn, s.hidden)),
                (b + "ffn_up.weight", (s.ffn, s.hidden)), (b + "ffn_down.weight", (s.hidden, s.ffn))]
    return out


def mmproj_tensors(s: Shape) -> list[tuple[str, tuple[int, ...]]]:
    h, f, merged = s.vision_hidden, s.vision_ffn, s.vision_hidden * 4
    out = [("v.patch_embd.weight", (h, 3, PATCH, PATCH)), ("v.patch_embd.weight.1", (h, 3, PATCH, PATCH))]
    for i in range(s.vision_depth):
        b = f"v.blk.{i}."
        out += [(b + "ln1.weight", (h,)), (b + "ln2.weight", (h,))]
        out += [(b + f"attn_{p}.{k}", (h, h) if k == "weight" else (h,)) for p in ("q", "k", "v", "out")
                for k in ("weight", "bias")]
        out += [(b + "ffn_gate.weight", (f, h)), (b + "ffn_gate.bias", (f,)), (b + "ffn_up.weight", (f, h)),
                (b + "ffn_up.bias", (f,)), (b + "ffn_down.weight", (h, f)), (b + "ffn_down.bias", (h,))]
    out += [("v.post_ln.weight", (h,)), ("mm.0.weight", (merged, merged)), ("mm.0.bias", (merged,)),
            ("mm.2.weight", (s.hidden, merged)), ("mm.2.bias", (s.hidden,))]
    return out


def write_f16(writer, table: list[tuple[str, tuple[int, ...]]], seed: int) -> None:
    """The tensors, F16 (F32 for 1-D ones: norms one, biases zero), one at a time: normal weights of scale 0.02
    from a pool read at a random offset each."""
    for name, dims in table:
        dtype = np.float16 if len(dims) > 1 else np.float32
        writer.add_tensor_info(name, dims, np.dtype(dtype), int(np.prod(dims)) * np.dtype(dtype).itemsize)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(1 << 24, dtype=np.float32) * 0.02).astype(np.float16)
    for name, dims in table:
        if len(dims) == 1:
            writer.write_tensor_data(np.full(dims, 0.0 if name.endswith(".bias") else 1.0, np.float32))
            continue
        start = int(rng.integers(len(pool)))
        writer.write_tensor_data(np.resize(np.roll(pool, -start), int(np.prod(dims))).reshape(dims))
    writer.close()


def make_pair(shape_name: str, files_dir: Path, llama_bin: Path, text_type: str) -> tuple[Path, Path]:
    """(text GGUF, mmproj) of the shape, made once into ``files_dir``."""
    import gguf
    s = SHAPES[shape_name]
    text = files_dir / f"{shape_name}-{text_type}.gguf"
    mmproj = files_dir / f"mmproj-{shape_name}-F16.gguf"
    files_dir.mkdir(parents=True, exist_ok=True)
    if not mmproj.exists():
        partial = mmproj.with_name(mmproj.stem + ".partial.gguf")
        w = gguf.GGUFWriter(partial, "clip")
        w.add_type(gguf.GGUFType.MMPROJ)
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_uint32("clip.vision.projection_dim", s.hidden)
        w.add_uint32("clip.vision.image_size", 560)
        w.add_uint32("clip.vision.patch_size", PATCH)
        w.add_uint32("clip.vision.embedding_length", s.vision_hidden)
        w.add_uint32("clip.vision.feed_forward_length", s.vision_ffn)
        w.add_uint32("clip.vision.block_count", s.vision_depth)
        w.add_uint32("clip.vision.attention.head_count", s.vision_heads)
        w.add_array("clip.vision.image_mean", [0.48145466, 0.4578275, 0.40821073])
        w.add_array("clip.vision.image_std", [0.26862954, 0.26130258, 0.27577711])
        w.add_string("clip.projector_type", "qwen2.5vl_merger")
        w.add_bool("clip.use_silu", True)
        w.add_uint32("clip.vision.n_wa_pattern", s.full_attention_every)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", EPS)
        write_f16(w, mmproj_tensors(s), seed=1)
        partial.rename(mmproj)
    if not text.exists():
        vocab = LLAMA_SRC / "models" / "ggml-vocab-qwen2.gguf"
        if not vocab.exists():
            raise SystemExit(f"no {vocab}: set LMPORT_LLAMA_CPP_SRC to llama.cpp's source directory")
        f16 = files_dir / f"{shape_name}-F16.gguf"
        w = gguf.GGUFWriter(f16, "qwen2vl")
        w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
        w.add_context_length(8192)
        w.add_embedding_length(s.hidden)
        w.add_block_count(s.layers)
        w.add_feed_forward_length(s.ffn)
        w.add_head_count(s.heads)
        w.add_head_count_kv(s.kv_heads)
        w.add_rope_freq_base(ROPE_THETA)
        w.add_layer_norm_rms_eps(EPS)
        w.add_rope_dimension_sections([*s.sections, 0])
        for key, value, kind, element in tokenizer_fields(vocab, N_VOCAB):
            if key == "tokenizer.ggml.tokens":
                value = [VISION_TOKENS.get(i, t) for i, t in enumerate(value)]
            elif key == "tokenizer.ggml.token_type":
                value = [gguf.TokenType.CONTROL if i in VISION_TOKENS else t for i, t in enumerate(value)]
            elif key == "tokenizer.chat_template":
                value = TEMPLATE
            w.add_key_value(key, value, kind, sub_type=element)
        write_f16(w, text_tensors(s), seed=2)
        if text_type == "F16":
            f16.rename(text)
        else:
            subprocess.run([str(llama_bin / "llama-quantize"), str(f16), str(text), text_type], check=True,
                           capture_output=True)
            f16.unlink()
    return text, mmproj


def image(seed: int) -> bytes:
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, (IMAGE_SIDE, IMAGE_SIDE, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


class Lmport:
    """lmport's engine on the pair, in process, on the cpu backend."""

    def __init__(self, text: Path, mmproj: Path):
        from lmport import EngineConfig
        from lmport.engine.llm import LLM
        from lmport.multimodal.loading import image_processor
        self.llm = LLM(str(text), EngineConfig(device_type="cpu", mmproj=str(mmproj), enable_prefix_caching=False))
        self.processor = image_processor(str(text), str(mmproj))

    def prompt(self, data: bytes):
        from lmport.multimodal.images import ImageLimits
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = self.llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return self.processor.prepare(self.llm.tokenizer.encode(text, add_special_tokens=False), [data],
                                      ImageLimits())

    def encode_seconds(self, data: bytes) -> float:
        _, images = self.prompt(data)
        start = time.perf_counter()
        self.llm.core.runner.model.run_tower(images)
        return time.perf_counter() - start

    def first_token_seconds(self, data: bytes) -> tuple[float, int]:
        from lmport import GenerationConfig
        ids, images = self.prompt(data)
        start = time.perf_counter()
        self.llm.add_request(ids, GenerationConfig(max_new_tokens=1, temperature=0.0, ignore_eos=True), images=images)
        while self.llm.has_unfinished():
            self.llm.step()
        return time.perf_counter() - start, len(ids)

    def close(self) -> None:
        self.llm.close()


class LlamaServer:
    """llama.cpp's llama-server on the pair (``--port 0``: the address from its log)."""

    def __init__(self, binary: Path, text: Path, mmproj: Path, threads: int, log: Path):
        import httpx
        self.log = log
        self.proc = subprocess.Popen([str(binary), "-m", str(text), "--mmproj", str(mmproj), "--port", "0",
                                      "-t", str(threads), "-tb", str(threads), "-c", "4096", "--no-warmup"],
                                     stdout=log.open("w"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 600
        while (match := re.search(r"listening on (http://\S+)", log.read_text(errors="replace"))) is None:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"llama-server did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.client = httpx.Client(base_url=match[1], timeout=600)
        while self.client.get("/health").status_code != 200:
            time.sleep(0.5)
        self.marker = self.client.get("/props").json()["media_marker"]

    def round(self, data: bytes) -> tuple[float, float, int]:
        """(the prompt's seconds as the server reports them, seconds to the first token, prompt tokens) of one
        request."""
        prompt = (f"<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n{self.marker}"
                  f"{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
        start = time.perf_counter()
        reply = self.client.post("/completion", json={
            "prompt": {"prompt_string": prompt, "multimodal_data": [base64.b64encode(data).decode()]},
            "n_predict": 1, "temperature": 0, "cache_prompt": False}).json()
        seconds = time.perf_counter() - start
        return reply["timings"]["prompt_ms"] / 1000, seconds, reply["tokens_evaluated"]

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="qwen2.5-vl-3b", choices=sorted(SHAPES))
    p.add_argument("--text-type", default="Q4_K_M", help="llama-quantize type of the text GGUF (or F16)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    p.add_argument("--files-dir", type=Path, default=DEFAULT_DIR)
    p.add_argument("--llama-bin", type=Path, default=DEFAULT_LLAMA_BIN)
    p.add_argument("--json", type=Path, default=None, help="write every round here")
    args = p.parse_args()
    import torch

    from lmport.bench.machine import cpu_info
    torch.set_num_threads(args.threads)
    text, mmproj = make_pair(args.shape, args.files_dir, args.llama_bin, args.text_type)
    ours = Lmport(text, mmproj)
    with tempfile.TemporaryDirectory() as tmp:
        theirs = LlamaServer(args.llama_bin / "llama-server", text, mmproj, args.threads, Path(tmp) / "server.log")
        rounds = []
        try:
            for r in range(args.rounds):
                data = image(1000 + r)
                encode = ours.encode_seconds(data)
                first, tokens = ours.first_token_seconds(image(2000 + r))
                l_prompt, l_first, l_tokens = theirs.round(image(3000 + r))
                rounds.append({"lmport": {"encode_s": encode, "first_token_s": first, "prompt_tokens": tokens},
                               "llama.cpp": {"prompt_s": l_prompt, "first_token_s": l_first,
                                             "prompt_tokens": l_tokens}})
        finally:
            theirs.close()
            ours.close()
    cpu = cpu_info()
    print(f"{args.shape} pair: {text.name} + {mmproj.name}; a {IMAGE_SIDE} x {IMAGE_SIDE} image "
          f"({rounds[0]['lmport']['prompt_tokens']} prompt tokens lmport, {rounds[0]['llama.cpp']['prompt_tokens']} "
          f"llama.cpp); CPU {cpu['model']}, {args.threads} threads each; {args.rounds} interleaved rounds, "
          f"median (min-max)")
    print(f"{'':<12}{'images/s through the encoder':>34}{'time to first token, s':>30}")
    ours_rate = summary([1 / r["lmport"]["encode_s"] for r in rounds])
    print(f"{'lmport':<12}{ours_rate:>34}{summary([r['lmport']['first_token_s'] for r in rounds]):>30}")
    print(f"{'llama.cpp':<12}{'not exposed by llama-server':>34}"
          f"{summary([r['llama.cpp']['first_token_s'] for r in rounds]):>30}")
    print(f"llama.cpp's own prompt time (image encoded + prompt prefilled, its reply's prompt_ms), s: "
          f"{summary([r['llama.cpp']['prompt_s'] for r in rounds])}")
    if args.json:
        args.json.write_text(json.dumps({"shape": args.shape, "threads": args.threads, "cpu": cpu,
                                         "rounds": rounds}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
