"""`lmport chat`: an interactive, streaming chat, in-process or against a server."""
from __future__ import annotations

import sys

from lmport.flags import engine_config, gen_config


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


def chat(args) -> int:
    messages = []
    if args.url:
        stream = _remote_stream(args.url, args.api_key, gen_config(args))
    else:
        import lmport
        pipe = lmport.pipeline(args.model, backend_config=engine_config(args))
        cfg = gen_config(args)

        def stream(messages):
            return pipe.stream(messages, cfg)
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


def _remote_stream(url: str, api_key: str | None, cfg=None):
    import os

    from openai import OpenAI
    client = OpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key or os.environ.get("LMPORT_API_KEY", "none"))
    model = client.models.list().data[0].id
    params = {} if cfg is None else _openai_params(cfg)

    def stream(messages):
        for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **params):
            if chunk.choices and chunk.choices[0].delta.content:
                yield chunk.choices[0].delta.content
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
