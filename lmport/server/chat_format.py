"""A server's chat format, fixed at start-up: the chat template (the model's, or ``--chat-template``), the
reasoning parser and the tool-call format, each the one named or else the one the template's family needs."""
from __future__ import annotations

import logging
from dataclasses import dataclass

from lmport import chat_template, reasoning, tool_parsers
from lmport.errors import ConfigError
from lmport.reasoning import Parser
from lmport.server.shapes import ChatCard

log = logging.getLogger(__name__)


@dataclass
class ChatFormat:
    template: str | None                 # "model", "given" (--chat-template), or None: chat requests are refused
    reasoning_parser: Parser | None
    tool_parser: str

    def card(self) -> ChatCard:
        """What /v1/models says about it."""
        return {"chat_template": self.template, "reasoning_parser": self.reasoning_parser and
                self.reasoning_parser.name, "tool_call_parser": self.tool_parser}


def load_template(value: str | None) -> str | None:
    """``--chat-template``'s template text (from its file, or the value itself), or a ConfigError saying why not."""
    try:
        return None if value is None else chat_template.load(value)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def configure(tokenizer, template: str | None = None, reasoning_parser: str | None = None,
              tool_parser: str | None = None) -> ChatFormat:
    """Set the chat format up on ``tokenizer``: ``template`` (a file or the template's text) replaces the
    model's; a parser named (``none``: no reasoning separation) is used, else the template's family's. A model
    left without a template is warned about here, once, and its chat requests are refused."""
    try:
        if template is not None:
            tokenizer.chat_template = chat_template.load(template)
        parser = reasoning.for_template(tokenizer.chat_template) if reasoning_parser is None \
            else reasoning.get(reasoning_parser)
        tool_format = tool_parsers.for_template(tokenizer.chat_template) if tool_parser is None \
            else tool_parsers.get(tool_parser)
    except (OSError, ValueError) as exc:
        raise ConfigError(str(exc)) from None
    if tokenizer.chat_template is None:
        log.warning("the model has no chat template: chat requests (/v1/chat/completions, /v1/messages, "
                    "/v1/responses) will be refused; give one with --chat-template FILE")
    source = None if tokenizer.chat_template is None else "given" if template is not None else "model"
    return ChatFormat(source, parser, tool_format)
