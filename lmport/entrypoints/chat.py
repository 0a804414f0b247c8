"""`lmport chat`: an interactive, streaming chat, in-process or against a server."""
from __future__ import annotations

import dataclasses
import sys

from lmport import reasoning
from lmport.entrypoints.flags import engine_config, gen_config


def _turns():
    while True:
        try:
            line = input("you> ")
        except EOFError:
            return
        if line.strip() in ("/exit", "/quit"):
            return
        if line.strip():
            yield line


def _show_thinking(text: str) -> None:
    """A reasoning model's thinking, on stderr (dimmed on a terminal), apart from the reply."""
    dim = sys.stderr.isatty()
    print(f"\033[2m{text}\033[0m" if dim else text, end="", file=sys.stderr, flush=True)


def chat(args) -> int:
    messages = []
    if args.url:
        stream = _remote_stream(args.url, args.api_key, gen_config(args), on_thinking=_show_thinking)
    else:
        import lmport
        pipe = lmport.pipeline(args.model, backend_config=engine_config(args))
        cfg = gen_config(args)
        parser = reasoning.for_template(pipe.tokenizer.chat_template)
        if parser is not None and parser.keeps_special_tokens:   # gpt-oss: its markers are special tokens
            cfg = dataclasses.replace(cfg, skip_special_tokens=False)

        def stream(messages):
            if parser is None:
                yield from pipe.stream(messages, cfg)
                return
            # The thinking shown apart and kept out of the history, as the server gives it (lmport.reasoning).
            prompt = pipe.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            splitter = parser.splitter(parser.starts_inside(prompt))
            for delta in pipe.stream(messages, cfg):
                thought, answer = splitter.feed(delta, False)
                if thought:
                    _show_thinking(thought)
                if answer:
                    yield answer
            thought, answer = splitter.feed("", True)
            if thought:
                _show_thinking(thought)
            if answer:
                yield answer
    print("lmport chat: /exit to leave", file=sys.stderr)
    for line in _turns():
        messages.append({"role": "user", "content": line})
        reply = []
        print("bot> ", end="", flush=True)
        for delta in stream(messages):
            reply.append(delta)
            print(delta, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})
    return 0


def _remote_stream(url: str, api_key: str | None, cfg=None, on_thinking=None):
    """A function of the messages that streams the server's reply text; its reasoning (``reasoning_content``)
    goes to ``on_thinking`` when given."""
    import os

    from openai import OpenAI
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or os.environ.get("LMPORT_API_KEY", "none"))
    model = client.models.list().data[0].id
    params = {} if cfg is None else _openai_params(cfg)

    def stream(messages):
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **params):
            if not chunk.choices:
                continue
            delta = chunk.choices[0].delta
            thought = (delta.model_extra or {}).get("reasoning_content")
            if thought and on_thinking is not None:
                on_thinking(thought)
            if delta.content:
                yield delta.content
    return stream


def _openai_params(cfg) -> dict:
    """The generation flags as OpenAI request fields, so `--url` samples as the local chat does (greedy by default)."""
    params = {"max_tokens": cfg.max_new_tokens, "temperature": 0.0 if cfg.greedy else cfg.temperature,
              "top_p": cfg.top_p,
              "extra_body": {"top_k": cfg.top_k, "min_p": cfg.min_p, "repetition_penalty": cfg.repetition_penalty,
                             "ignore_eos": cfg.ignore_eos}}
    if cfg.random_seed is not None:
        params["seed"] = cfg.random_seed
    if cfg.stop_words:
        params["stop"] = cfg.stop_words
    return params
