"""Chat templates: the model's own, or one given at start-up, rendered with the request's variables.

A conversation becomes a prompt only through a template. A model whose tokenizer has none (a base model) is
given one with ``--chat-template`` (a file, or the template's text itself); until then its chat requests are
refused with an error that says so, never joined into a prompt some other way. Plain text prompts
(completions, ``lmport generate --raw``) need no template.
"""
from __future__ import annotations

import os

# apply_chat_template's own arguments: a request's chat_template_kwargs may not set them.
RESERVED_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template", "tokenize",
                             "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
                             "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask"})

NO_TEMPLATE = ("the model has no chat template, so a conversation cannot be turned into its prompt: start the "
               "server with --chat-template FILE (the template of the model's family), or send plain text to "
               "/v1/completions")


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template and none was given."""


def load(value: str) -> str:
    """``--chat-template``'s value: the text of the file it names, else the value itself when it is a Jinja
    template; anything else is an error naming both readings."""
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise ValueError(f"--chat-template {value!r}: no such file, and not a Jinja template either (no {{{{ or {{% "
                     f"in it); give the path of a .jinja file or the template's text")


def check_kwargs(kwargs: dict | None, param: str = "chat_template_kwargs") -> dict:
    """The request's template variables, with a ValueError naming one that would replace a rendering argument."""
    kwargs = dict(kwargs or {})
    for name in kwargs:
        if name in RESERVED_KWARGS:
            raise ValueError(f"{param}.{name}: this is set by the server (or the request's own field of that "
                             f"name), not a template variable; leave it out")
    return kwargs


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None, *, add_generation_prompt: bool = True,
           continue_final_message: bool = False, kwargs: dict | None = None) -> str:
    """The conversation as the template writes it (text, not yet tokenized)."""
    if tokenizer.chat_template is None:
        raise NoChatTemplate(NO_TEMPLATE)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message,
                                         **({"tools": tools} if tools else {}), **(kwargs or {}))

