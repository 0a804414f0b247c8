"""llama.cpp's ``llama-server`` as a reference for tests: its ``/tokenize`` and ``/apply-template``.

- ``server_binary()``: ``llama-server`` in ``LMPORT_LLAMA_CPP_BIN``, or None where that is unset or holds no
  server (CI has no llama.cpp: the tests that use it skip).
- ``with_tiny_body(vocab, out)``: a GGUF llama-server can load, made of a vocabulary-only file. llama-server
  has no vocabulary-only mode, and llama.cpp's tokenizer and chat template read only the ``tokenizer.*``
  keys whatever the architecture (bar BERT's), so the file's tokenizer keys go over a tiny random-weight
  Llama body.
- ``LlamaServer(binary, gguf, log)``: one server per file, started with ``--port 0``; llama-server binds
  any free port for 0 and prints ``listening on http://HOST:PORT``, so the address comes from that line and
  no port is chosen, released and bound again.
"""
from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import httpx
import numpy as np

from support.llama_cpp_tokens import metadata_fields
from support.serve_process import wait_for_line

# main: listening on http://127.0.0.1:43125 (printed before the model loads; /health says when it has)
LISTENING = re.compile(r"listening on (http://\S+)")
EMBED, FFN, HEADS = 16, 32, 2   # the body's sizes: the smallest llama.cpp's Llama graph accepts, in effect


def server_binary() -> Path | None:
    """``$LMPORT_LLAMA_CPP_BIN/llama-server``, or None."""
    bins = os.environ.get("LMPORT_LLAMA_CPP_BIN")
    path = Path(bins) / "llama-server" if bins else None
    return path if path is not None and path.exists() else None


def skip_reason() -> str:
    bins = os.environ.get("LMPORT_LLAMA_CPP_BIN")
    return (f"llama-server not found in LMPORT_LLAMA_CPP_BIN={bins}" if bins else
            "LMPORT_LLAMA_CPP_BIN is not set: point it at a llama.cpp build's bin directory (with llama-server)")


def with_tiny_body(vocab: Path, out: Path, chat_template: str | None = None) -> Path:
    """``vocab``'s ``tokenizer.*`` metadata over a one-layer random-weight Llama (float32, 16 wide);
    ``chat_template``, where given, in place of the file's own."""
    import gguf
    fields = [f for f in metadata_fields(vocab) if f[0].startswith("tokenizer.") or f[0] == "general.name"]
    if chat_template is not None:
        fields = [f for f in fields if f[0] != "tokenizer.chat_template"]
        fields.append(("tokenizer.chat_template", chat_template, gguf.GGUFValueType.STRING, None))
    n_vocab = len(next(value for key, value, *_ in fields if key == "tokenizer.ggml.tokens"))
    writer = gguf.GGUFWriter(out, "llama")
    for key, value, kind, element in fields:
        writer.add_key_value(key, value, gguf.GGUFValueType(kind),
                             sub_type=gguf.GGUFValueType(element) if element is not None else None)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_context_length(256)
    writer.add_embedding_length(EMBED)
    writer.add_block_count(1)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    writer.add_tensor("token_embd.weight", weight(n_vocab, EMBED))   # tied: no output.weight
    writer.add_tensor("output_norm.weight", np.ones(EMBED, np.float32))
    for name, shape in (("attn_norm", (EMBED,)), ("ffn_norm", (EMBED,)), ("attn_q", (EMBED, EMBED)),
                        ("attn_k", (EMBED, EMBED)), ("attn_v", (EMBED, EMBED)), ("attn_output", (EMBED, EMBED)),
                        ("ffn_gate", (FFN, EMBED)), ("ffn_up", (FFN, EMBED)), ("ffn_down", (EMBED, FFN))):
        writer.add_tensor(f"blk.0.{name}.weight", np.ones(shape, np.float32) if len(shape) == 1 else weight(*shape))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


class LlamaServer:
    """``llama-server -m GGUF --port 0`` (one thread, CPU, a 256-token context), its output in ``log``; a
    context manager that stops it."""

    def __init__(self, binary: Path, gguf: Path, log: Path, extra: tuple[str, ...] = ()):
        self.log = log
        argv = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", "0", "-c", "256", "-np", "1",
                "-t", "1", "-ngl", "0", "--no-warmup", "--jinja", *extra]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self.client: httpx.Client | None = None

    def __enter__(self) -> LlamaServer:
        try:
            url = wait_for_line(self.proc, self.log, LISTENING, timeout=120).group(1)
            self.client = httpx.Client(base_url=url, timeout=120)
            self._wait_until_loaded()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _wait_until_loaded(self, timeout: float = 300) -> None:
        """/health answers 503 while the model loads, 200 once it has."""
        import time
        assert self.client is not None
        deadline = time.monotonic() + timeout
        while (status := self.client.get("/health").status_code) != 200:
            assert self.proc.poll() is None, f"llama-server exited {self.proc.returncode}:\n{self.log.read_text()}"
            assert status == 503 and time.monotonic() < deadline, f"/health {status}:\n{self.log.read_text()}"
            time.sleep(0.1)

    def _post(self, route: str, body: dict) -> dict:
        assert self.client is not None
        reply = self.client.post(route, json=body)
        assert reply.status_code == 200, f"{route} {body!r}: {reply.status_code} {reply.text}"
        return reply.json()

    def tokenize(self, text: str, add_special: bool) -> list[int]:
        """``/tokenize`` with special tokens matched in the text (as lmport does), ids only."""
        return self._post("/tokenize", {"content": text, "add_special": add_special, "parse_special": True,
                                        "with_pieces": False})["tokens"]

    def apply_template(self, messages: list[dict], **options) -> str | None:
        """``/apply-template``: the prompt the file's chat template makes of ``messages`` (``options``: the
        chat request's fields, e.g. ``add_generation_prompt``); None where the server refuses the conversation
        (a template that raises, as Gemma's does for a system message)."""
        assert self.client is not None
        reply = self.client.post("/apply-template", json={"messages": messages, **options})
        if 400 <= reply.status_code < 600 and reply.status_code != 503 and "error" in reply.json():
            return None
        assert reply.status_code == 200, f"/apply-template: {reply.status_code} {reply.text}"
        return reply.json()["prompt"]

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
