"""The way back that Anthropic's messages and OpenAI's responses share (lmport.server.anthropic, .responses).

Both translate a request into a chat completions request, run it through the chat path
(lmport.server.routes.chat_prompt) and turn the engine's output into their own shapes. What they have in
common on the way back is here: one choice's streamed output as text and tool-call pieces, the stop sequence
that ended an output, and an error renamed to the API's own field.
"""
from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from lmport.engine import detokenize
from lmport.engine.outputs import RequestOutput
from lmport.reasoning import Reasoning
from lmport.server import tools
from lmport.server.frontend import Frontend, Job
from lmport.server.openai_mapping import finish_reason
from lmport.server.protocol import APIError
from lmport.server.shapes import ReplyToolCall
from lmport.server.streaming import outputs


@dataclass
class Piece:
    kind: Literal["thinking", "text", "call", "arguments"]
    text: str   # the thinking, the text, the called function's name, or a piece of the call's arguments (JSON text)


async def pieces(frontend: Frontend, job: Job, setup: tools.ToolSetup | None, reasoning: Reasoning | None = None
                 ) -> AsyncIterator[tuple[list[Piece], RequestOutput]]:
    """The job's one choice as it is generated: (its new pieces, the output so far).

    With ``reasoning``, the reply's thinking comes as "thinking" pieces (lmport.reasoning.Splitter), before
    the answer. With tools, a call comes as a "call" piece (the function's name) and then its arguments' JSON
    text in "arguments" pieces, which concatenate to the non-streamed call's arguments; text that may begin a
    call is held back until it is known (lmport.server.tools.StreamParser). A failed generation raises
    APIError(500).
    """
    parser = tools.stream_parser(setup) if setup is not None else None
    splitter = reasoning.splitter() if reasoning is not None else None
    sent = 0
    stream = outputs(frontend, job)
    try:
        async for _, out in stream:
            finish_reason(out)   # raises for a generation that failed in the engine
            delta = out.text[sent:]
            sent += len(delta)
            thought, delta = splitter.feed(delta, out.finished) if splitter is not None else ("", delta)
            text, calls = parser.feed(delta, out.finished) if parser is not None else (delta, [])
            new = [Piece("thinking", thought)] if thought else []
            new += [Piece("text", text)] if text else []
            for call in calls:
                function = call["function"]
                if "id" in call:   # a call's first delta names the function
                    new.append(Piece("call", function["name"]))
                if function.get("arguments"):
                    new.append(Piece("arguments", function["arguments"]))
            yield new, out
    finally:
        await stream.aclose()


def reply_calls(out: RequestOutput, setup: tools.ToolSetup | None, reasoning: Reasoning | None = None
                ) -> tuple[str, list[ReplyToolCall]]:
    """A finished output's answer text (without its thinking) and tool calls (OpenAI's chat shape:
    {"function": {"name", "arguments"}})."""
    answer = out.text if reasoning is None else reasoning.split(out.text)[1]
    if setup is None:
        return answer, []
    text, calls = tools.parse(answer, setup)
    return text or "", calls


def reply_thinking(out: RequestOutput, reasoning: Reasoning | None) -> str | None:
    """A finished output's thinking, or None when it has none."""
    return None if reasoning is None else reasoning.split(out.text)[0]


def stop_sequence(tokenizer, out: RequestOutput, stop_words: list[str] | None) -> str | None:
    """The stop string that ended ``out``, or None (it ended otherwise).

    The engine cuts the text before the first stop string and says only "stop"; the whole output decoded again
    holds the stop string where the text was cut (an output that did not end on one contains none at all).
    """
    if out.finish_reason != "stop" or not stop_words:
        return None
    full = detokenize.decode(tokenizer, out.token_ids, skip_special_tokens=True)
    hits = sorted((full.find(word), -len(word), word) for word in stop_words if word in full)
    return hits[0][2] if hits else None


def renamed(exc: APIError, rename: Callable[[str], str]) -> APIError:
    """``exc`` with its field (``param`` and the field path the message starts with) renamed to the API's own."""
    if exc.param is None or (param := rename(exc.param)) == exc.param:
        return exc
    head = re.match(r"[\w.]+", exc.message)
    message = exc.message
    if head and head.group().startswith(exc.param):
        message = rename(head.group()) + message[head.end():]
    return APIError(exc.status, message, param, exc.type, exc.code, exc.headers)
