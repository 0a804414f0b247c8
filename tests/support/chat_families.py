"""Chat-template families for tests: real templates (tests/data/chat_templates/, copied from llama.cpp's
models/templates/, which holds each model's own template as published) over a tiny random-weight model whose
tokenizer knows every family's marker tokens, and a way to make the engine emit an exact reply.

The markers are added as the families' tokenizers have them: ordinary added tokens (``<think>`` is one token
in Qwen3's, DeepSeek's and GLM's vocabularies), so they decode to their text.
"""
from __future__ import annotations

import contextlib
import functools
from pathlib import Path

import torch

from test_server import ServerThread
from support.saved_dirs import save_once

TEMPLATES = Path(__file__).parents[1] / "data" / "chat_templates"
FAMILY_TEMPLATES = {
    "qwen3": "Qwen-Qwen3-0.6B.jinja",
    "deepseek_r1": "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja",
    "glm45": "GLM-4.6.jinja",
    "llama3": "meta-llama-Llama-3.2-3B-Instruct.jinja",
    "mistral": "mistralai-Mistral-Nemo-Instruct-2407.jinja",
    "deepseek_v3": "deepseek-ai-DeepSeek-V3.1.jinja",
    "qwen3_coder": "Qwen3-Coder.jinja",
    "gpt_oss": "openai-gpt-oss-120b.jinja",
}
MARKERS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>",
           "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>",
           "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
           "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
           "<｜tool▁output▁end｜>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>",
           "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<|python_tag|>", "[INST]", "[/INST]", "[TOOL_CALLS]",
           "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# gpt-oss's harmony markers are special tokens in its tokenizer: added as such (a reply is decoded with them kept).
HARMONY_MARKERS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"]
EXTRA_VOCAB = 128   # rows of the model's embedding beyond the default model's 49,152 tokens


def template(family: str) -> str:
    return (TEMPLATES / FAMILY_TEMPLATES[family]).read_text()


@functools.cache
def family_model_dir() -> str:
    """A tiny random-weight Qwen3 model whose tokenizer (the default model's) has every family's markers added."""
    import transformers

    from lmport.models.loader import cache_root, load_tokenizer
    target = cache_root() / "test-models" / "tiny-qwen3-chat-families-v3"
    if not (target / "config.json").exists():
        torch.manual_seed(1234)
        config = transformers.Qwen3Config(vocab_size=49152 + EXTRA_VOCAB, hidden_size=64, intermediate_size=128,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          head_dim=32, max_position_embeddings=2048, tie_word_embeddings=False,
                                          bos_token_id=1, eos_token_id=2)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        tokenizer = load_tokenizer("smollm2")
        tokenizer.add_tokens(MARKERS)
        tokenizer.add_tokens(HARMONY_MARKERS, special_tokens=True)
        assert len(tokenizer) <= config.vocab_size
        # The end of the turn, and gpt-oss's ends of a reply (as its generation config names them).
        model.generation_config.eos_token_id = [2, *(tokenizer.convert_tokens_to_ids(t) for t in ("<|return|>",
                                                                                               "<|call|>"))]
        save_once(target, model, tokenizer)
    return str(target)


class Script:
    """What the engine samples instead of drawing: each request's next token is ``tokens[len(its output)]``.

    A structured output's mask still applies: a scripted token the mask forbids is recorded in ``forbidden``
    (and emitted anyway, so the test sees where), which is how a test checks what a grammar allowed.
    """

    def __init__(self, tokens: list[int]):
        self.tokens, self.forbidden = list(tokens), []

    def sample(self, logits, ready, mask=None):
        rows, bitmask = mask if mask else ([], None)
        out = []
        for i, seq in enumerate(ready):
            token = self.tokens[len(seq.output_ids)]
            if bitmask is not None and i in rows and not (int(bitmask[i, token // 32]) >> (token % 32)) & 1:
                self.forbidden.append((len(seq.output_ids), token))
            out.append((seq, token, None))
        return out


@contextlib.contextmanager
def scripted(engine, tokens: list[int]):
    """While the block runs, ``engine`` (and any other engine of this process: the tests run one request at a
    time) emits ``tokens`` (Script) for every request, in place of the worker's sampling."""
    from lmport.worker import model_step
    script = Script(tokens)
    drawn, model_step.sample_each = model_step.sample_each, script.sample
    try:
        yield script
    finally:
        model_step.sample_each = drawn


class FamilyServers:
    """Servers of the family model, one per (family, create_app options), each given the family's template
    (--chat-template; the model's own is ChatML), made on first use and stopped by ``close``."""

    def __init__(self):
        self.made: dict = {}

    def __call__(self, family: str, **options):
        key = (family, tuple(sorted(options.items())))
        if key not in self.made:
            from lmport.config import EngineConfig
            from lmport.engine.engine import Engine
            from lmport.server.app import create_app
            engine = Engine(family_model_dir(), EngineConfig(cache_max_entry_count=128))
            app = create_app(engine, model_name="tiny", chat_template=str(TEMPLATES / FAMILY_TEMPLATES[family]),
                             **options)
            self.made[key] = (ServerThread(app), engine)
        return self.made[key]

    def close(self):
        for thread, _ in self.made.values():
            thread.stop()


def reply_ids(engine, text: str) -> list[int]:
    """The token ids of a scripted reply: ``text``, then the end of the turn (unless it ends with one of
    gpt-oss's, which end the reply)."""
    ends = text.endswith(("<|return|>", "<|call|>"))
    return engine.tokenizer.encode(text, add_special_tokens=False) + ([] if ends else [2])
