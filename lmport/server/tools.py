"""Tool calling on chat: tools into the prompt, Hermes-style ``<tool_call>`` blocks out of the text.

The tools reach the model through its chat template (``apply_chat_template(tools=...)``) when the
template uses them; otherwise a generic system prompt (``GENERIC_PROMPT``) teaches the same format.
Calls are parsed from the output in that format, the one Qwen 2.5/3 and Hermes templates teach::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

``tool_choice: "required"`` or a named function constrains decoding to one such block whose
arguments match the function's ``parameters`` schema (an xgrammar grammar, lmport.structured_output.grammar).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import cast

from lmport import chat_template
from lmport.structured_output.grammar import Grammars, GuidedDecodingError, enforceable_schema, grammar_key
from lmport.tool_parsers.formats import ARGS, FORMATS, ToolFormat, Unconstrainable, rebase
from lmport.server.protocol import APIError, ChatCompletionRequest
from lmport.server.shapes import ReplyToolCall, ToolCallDelta

OPEN, CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOLS = 128
CALL_BLOCK = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.S)

GENERIC_PROMPT = """You can call functions. The functions, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, answer with {how}, exactly like this:
{example}"""
HERMES_EXAMPLE = '<tool_call>\n{"name": <function-name>, "arguments": <arguments-json-object>}\n</tool_call>'


@dataclass
class ToolSetup:
    tools: list[dict]                  # OpenAI's tool objects, {"type": "function", "function": {...}}
    names: list[str]
    choice: str                        # "auto", "required" or a function's name
    response_format: dict | None       # the grammar forcing a call ("required" or a named function)
    format: ToolFormat | None = None   # the family's call format (lmport.tool_parsers), None: Hermes'
    parallel: bool = True              # parallel_tool_calls: false keeps only a reply's first call

    @property
    def forced_spans_reasoning(self) -> bool:
        """Whether the forced call's grammar spells the reply from its start, reasoning included."""
        return self.response_format is not None and self.format is not None and self.format.spans_reasoning

    @property
    def schemas(self) -> dict[str, dict]:
        return {t["function"]["name"]: t["function"]["parameters"] for t in self.tools}


def check(req: ChatCompletionRequest, grammars: Grammars, format_name: str = "hermes") -> ToolSetup | None:
    """The request's tools and tool_choice, each checked (a 400 naming the field), in the tool-call format
    ``format_name`` (lmport.tool_parsers); None when no tool may be called."""
    fmt = None if format_name == "hermes" else FORMATS[format_name]
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice: there are no tools to choose from; give tools or leave tool_choice "
                                "out", param="tool_choice")
        return None
    if len(req.tools) > MAX_TOOLS:
        raise APIError(400, f"tools: {len(req.tools)} tools is more than {MAX_TOOLS} (OpenAI's limit too); give fewer",
                       param="tools")
    tools, names = [], []
    for i, tool in enumerate(req.tools):
        if tool.get("type") != "function":
            raise APIError(400, f"tools.{i}.type: only \"function\" tools are supported, got {tool.get('type')!r}",
                           param=f"tools.{i}.type")
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise APIError(400, f"tools.{i}.function: give an object with a non-empty name",
                           param=f"tools.{i}.function")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise APIError(400, f"tools.{i}.function.parameters: must be a JSON schema object",
                           param=f"tools.{i}.function.parameters")
        try:   # a schema the grammar engine refuses is refused now, whatever tool_choice says
            grammars.compile({"type": "json_schema", "json_schema": {"schema": params}})
        except GuidedDecodingError as exc:
            param = f"tools.{i}.function.parameters"
            message = re.sub(r"^response_format(\.json_schema\.schema)?", param, str(exc))
            raise APIError(400, message, param=param) from None
        tools.append({"type": "function", "function": {**fn, "parameters": params}})
        names.append(fn["name"])
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if choice.get("type") == "function" and isinstance(fn, dict) else None
        if name not in names:
            raise APIError(400, f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(names)})"
                           if name else 'tool_choice: give {"type": "function", "function": {"name": ...}}',
                           param="tool_choice.function.name" if name else "tool_choice")
        choice = name
    elif choice not in ("none", "auto", "required"):
        raise APIError(400, f'tool_choice: must be "none", "auto", "required" or a named function, got {choice!r}',
                       param="tool_choice")
    if choice == "none":
        return None
    forced = None
    if choice != "auto":
        chosen = [t["function"] for t in tools if choice == "required" or t["function"]["name"] == choice]
        try:
            forced = {"type": "grammar", "grammar": call_grammar(chosen, fmt)}
        except Unconstrainable as exc:
            raise APIError(400, f"tool_choice: a forced call in the {format_name} format cannot be constrained: "
                                f"{exc}", param="tool_choice") from None
    return ToolSetup(tools, names, choice, forced, fmt, req.parallel_tool_calls)


def call_grammar(functions: list[dict], fmt: ToolFormat | None = None) -> str:
    """EBNF for one call of any of ``functions`` in the format ``fmt`` (None: a Hermes block), its arguments
    matching the function's parameters (Unconstrainable: a parameter the format's text cannot state)."""
    import xgrammar as xgr   # only where a request forces a tool call
    if fmt is not None:
        return str(fmt.grammar(functions))
    grammars = []
    for fn in functions:
        schema = {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": {"$ref": ARGS}},
                  "required": ["name", "arguments"],
                  "$defs": {ARGS.rsplit("/", 1)[1]: enforceable_schema(rebase(fn["parameters"]))}}
        grammars.append(xgr.Grammar.concat(xgr.Grammar.from_ebnf(f'root ::= {json.dumps(OPEN + chr(10))}'),
                                           xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False),
                                           xgr.Grammar.from_ebnf(f'root ::= {json.dumps(chr(10) + CLOSE)}')))
    return str(grammars[0] if len(grammars) == 1 else xgr.Grammar.union(*grammars))


def turn_format(response_format: dict | None, setup: ToolSetup) -> dict | None:
    """The format this turn is generated under. A forced call: its grammar alone (OpenAI applies the
    request's format to text replies, and this reply is a call). tool_choice auto with a format: a call, or
    the format's output (so the format never rules a call out)."""
    if setup.response_format is not None or response_format is None or response_format.get("type") == "text":
        return setup.response_format or response_format
    if setup.format is not None and setup.format.spans_reasoning:
        return response_format   # the format applies to the final answer, which a call is not part of
    import xgrammar as xgr
    try:
        calls = call_grammar([t["function"] for t in setup.tools], setup.format)
    except Unconstrainable:   # a tool the grammar cannot state: the format alone (no call can be generated then)
        return response_format
    kind, text = cast("tuple[str, str]", grammar_key(response_format))
    if kind == "json_schema":
        answer = xgr.Grammar.from_json_schema(json.dumps(enforceable_schema(json.loads(text))),
                                              any_whitespace=False, strict_mode=True)
    elif kind == "regex_schema":
        answer = xgr.Grammar.from_regex(text)
    else:
        answer = xgr.Grammar.from_ebnf(text)
    return {"type": "grammar", "grammar": str(xgr.Grammar.union(xgr.Grammar.from_ebnf(calls), answer))}


def template_messages(req: ChatCompletionRequest, native: bool, fmt: ToolFormat | None = None) -> list[dict]:
    """The conversation as chat-template messages; tool turns as the template expects (``native``) or as text."""
    messages = []
    for i, m in enumerate(req.messages):
        msg = {"role": m.role, "content": m.template_content()}   # a user's images as parts
        if m.tool_calls and m.role != "assistant":
            raise APIError(400, f"messages.{i}.tool_calls: only assistant messages carry tool calls",
                           param=f"messages.{i}.tool_calls")
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError(400, f"messages.{i}.tool_call_id: a tool message must name the call it answers",
                               param=f"messages.{i}.tool_call_id")
            if native:
                msg.update(tool_call_id=m.tool_call_id, **({"name": m.name} if m.name else {}))
            else:
                msg = {"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"}
        if m.tool_calls:
            calls = []
            for j, call in enumerate(m.tool_calls):
                try:
                    arguments = json.loads(call.function.arguments)
                except json.JSONDecodeError:
                    arguments = None
                if not isinstance(arguments, dict):
                    param = f"messages.{i}.tool_calls.{j}.function.arguments"
                    raise APIError(400, f"{param}: must be a JSON object as text, got {call.function.arguments!r}",
                                   param=param)
                calls.append({"id": call.id, "type": "function",
                              "function": {"name": call.function.name, "arguments": arguments}})
            if native:
                msg["tool_calls"] = calls
            else:
                blocks = [fmt.render([c["function"] for c in calls])] if fmt is not None else \
                    [f"{OPEN}\n{json.dumps(c['function'], ensure_ascii=False)}\n{CLOSE}" for c in calls]
                msg["content"] = "\n".join(filter(None, [msg["content"], *blocks]))
        messages.append(msg)
    return messages


def template_switches(req: ChatCompletionRequest) -> dict:
    """add_generation_prompt and continue_final_message for the chat template, checked (a 400 naming them)."""
    if req.continue_final_message and req.add_generation_prompt:
        raise APIError(400, "continue_final_message and add_generation_prompt cannot both be true: to continue "
                            "the last assistant message, set add_generation_prompt to false",
                       param="continue_final_message")
    if req.continue_final_message and (not req.messages or req.messages[-1].role != "assistant"):
        raise APIError(400, "continue_final_message: the last message must be the assistant's message to continue",
                       param="continue_final_message")
    return {"add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message}


def template_knows_tools(tokenizer) -> bool:
    return "tools" in (tokenizer.chat_template or "")


def encode(tokenizer, req: ChatCompletionRequest, setup: ToolSetup | None) -> list[int]:
    """Token ids of the conversation with its tools, through the chat template."""
    return encode_text(tokenizer, req, setup)[0]


def encode_text(tokenizer, req: ChatCompletionRequest, setup: ToolSetup | None) -> tuple[list[int], str]:
    """(token ids, text) of the conversation with its tools, through the chat template and with the request's
    chat_template_kwargs.

    Only the template's own markup becomes special tokens: a special token's text inside a message,
    a tool call or a tool (``<|im_end|>`` typed by a user) is tokenized as plain text, so content
    cannot open or close turns.
    """
    turn = template_switches(req)
    try:
        kwargs = chat_template.check_kwargs(req.chat_template_kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param="chat_template_kwargs") from None
    if tokenizer.chat_template is None:
        raise APIError(400, f"messages: {chat_template.NO_TEMPLATE}", param="messages", code="no_chat_template")
    native = template_knows_tools(tokenizer)
    fmt = setup.format if setup is not None else None
    messages = template_messages(req, native, fmt)
    tools = setup.tools if setup is not None else None
    if setup is not None and not native:
        prompt = GENERIC_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in setup.tools),
                                       how="the call" if fmt else "one block per call",
                                       example=fmt.example if fmt else HERMES_EXAMPLE)
        if messages and messages[0]["role"] in ("system", "developer"):
            messages[0] = {**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}
        else:
            messages.insert(0, {"role": "system", "content": prompt})
        tools = None
    special = _special_texts(tokenizer)
    found = special.search(json.dumps([messages, tools], ensure_ascii=False)) if special else None
    if found is None:
        text = chat_template.render(tokenizer, messages, tools, kwargs=kwargs, **turn)
        return tokenizer.encode(text, add_special_tokens=False), text
    # Each special token's text in the input becomes a placeholder the template passes through; the
    # rendered prompt is tokenized with the template's specials, each placeholder as the plain text it stands for.
    nonce = f"lmportliteral{uuid.uuid4().hex}x"
    texts: list[str] = []

    def hide(value):
        if isinstance(value, str):
            def sub(m):
                texts.append(m.group(0))
                return f"{nonce}{len(texts) - 1}x"
            return special.sub(sub, value)
        if isinstance(value, dict):
            return {k: hide(v) for k, v in value.items()}
        if isinstance(value, list):
            return [hide(v) for v in value]
        return value
    messages, tools = hide(messages), hide(tools)
    rendered = chat_template.render(tokenizer, messages, tools, kwargs=kwargs, **turn)
    ids: list[int] = []
    pieces = []
    for i, piece in enumerate(re.split(f"{nonce}([0-9]+)x", rendered)):
        if i % 2:
            ids += tokenizer.encode(texts[int(piece)], add_special_tokens=False, split_special_tokens=True)
            pieces.append(texts[int(piece)])
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False)
            pieces.append(piece)
    return ids, "".join(pieces)


def _special_texts(tokenizer) -> re.Pattern | None:
    """A pattern matching the text of any of the tokenizer's special tokens (cached on the tokenizer)."""
    if hasattr(tokenizer, "_lmport_special_texts"):
        return cast("re.Pattern | None", tokenizer._lmport_special_texts)
    words = {t.content for t in getattr(tokenizer, "added_tokens_decoder", {}).values() if t.special}
    words.update(tokenizer.all_special_tokens)
    words.discard("")
    pattern = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))) if words else None
    tokenizer._lmport_special_texts = pattern
    return pattern


def parse(text: str, setup: ToolSetup) -> tuple[str | None, list[ReplyToolCall]]:
    """(content, tool_calls) of a reply, in the setup's format; only the first call without parallel calls."""
    content, calls = _parse_hermes(text, setup) if setup.format is None else _parse_family(text, setup)
    return content, calls if setup.parallel else calls[:1]


def _parse_family(text: str, setup: ToolSetup) -> tuple[str | None, list[ReplyToolCall]]:
    """A reply in one of lmport.tool_parsers' formats: the text before its calls, and the calls; the whole text
    as content when what follows the marker is no call to a given tool."""
    fmt = cast(ToolFormat, setup.format)
    at = fmt.start(text)
    found = fmt.read(text[at:], setup.schemas) if at is not None else None
    if not found or any(name not in setup.names for name, _ in found):
        return text, []
    content = text[:at].strip()
    return content or None, [{"id": fmt.call_id(), "type": "function", "function": {"name": name, "arguments": args}}
                             for name, args in found]


def _parse_hermes(text: str, setup: ToolSetup) -> tuple[str | None, list[ReplyToolCall]]:
    """(content, tool_calls) of a reply: every well-formed block naming a tool becomes a call.

    A reply with a malformed block is left as plain content (no calls), as the model did not
    produce a call the client could run.
    """
    calls: list[ReplyToolCall] = []
    for block in CALL_BLOCK.findall(text):
        call = _call(block, setup)
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = CALL_BLOCK.sub("", text).strip()
    return content or None, calls


# The start of a block in the taught key order, up to where the arguments' JSON text begins.
HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\S)')


def _call(block: str, setup: ToolSetup) -> ReplyToolCall | None:
    """The call a block's JSON text makes, or None when it is malformed or names no given tool.

    ``arguments`` is the model's own JSON text when the block is in the taught order (so a stream can
    send it as it is generated), else the arguments re-serialized.
    """
    try:
        data = json.loads(block)
    except json.JSONDecodeError:
        return None
    if not isinstance(data, dict) or data.get("name") not in setup.names:
        return None
    arguments = data.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    text = json.dumps(arguments, ensure_ascii=False)
    header = HEADER.match(block)
    if header and not isinstance(data["arguments"], str):
        raw = block[header.end():].rstrip()
        if raw.endswith("}") and _loads_or_none(raw[:-1]) == arguments:
            text = raw[:-1].rstrip()
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": data["name"], "arguments": text}}


def _loads_or_none(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def stream_parser(setup: ToolSetup):
    """A parser of one choice's streamed reply in the setup's format: ``feed(delta, finished)`` gives
    (content, tool-call deltas); only the first call's deltas without parallel calls."""
    parser = StreamParser(setup) if setup.format is None else FamilyStream(setup)
    return parser if setup.parallel else FirstCallOnly(parser)


class FirstCallOnly:
    """A stream parser's deltas of its first call only (parallel_tool_calls false), as ``parse`` keeps it."""

    def __init__(self, parser):
        self.parser = parser

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        content, calls = self.parser.feed(delta, finished)
        return content, [c for c in calls if c["index"] == 0]


class FamilyStream:
    """A streamed reply in one of lmport.tool_parsers' formats: text until a marker (text that may begin one is
    held back), then the calls, each sent whole once the reply has ended (as ``parse`` reads them)."""

    def __init__(self, setup: ToolSetup):
        self.setup, self.fmt = setup, cast(ToolFormat, setup.format)
        self.buffer = ""
        self.mode = "text"   # "calls" once a marker is seen; "plain" once a reply that must start with one did not

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += delta
        content = ""
        if self.mode == "text":
            at = self.fmt.start(self.buffer)
            if at is not None:
                content, self.buffer, self.mode = self.buffer[:at], self.buffer[at:], "calls"
            elif self.fmt.at_start:
                head = self.buffer.lstrip()
                if not finished and any(m.startswith(head) for m in self.fmt.markers):
                    return "", []
                self.mode = "plain"
            else:
                keep = 0 if finished else max(_partial_prefix(self.buffer, m) for m in self.fmt.markers)
                content, self.buffer = self.buffer[:len(self.buffer) - keep], self.buffer[len(self.buffer) - keep:]
                return content, []
        if self.mode == "plain":
            content, self.buffer = content + self.buffer, ""
            return content, []
        if not finished:
            return content, []
        text, self.buffer = self.buffer, ""
        rest, calls = _parse_family(text, self.setup)
        if not calls:
            return content + text, []
        return content + (rest or ""), [{"index": i, **call} for i, call in enumerate(calls)]


class StreamParser:
    """Splits a streamed reply into content deltas and tool-call deltas, one choice at a time.

    Text that may be the start of a ``<tool_call>`` block is held back until it is known. Inside a
    block, as OpenAI streams: once the name is known, a delta with the call's index, id, type and
    name (arguments ""); then the arguments' text in pieces as it is generated (the last few
    characters wait until the block closes, as they may be its end). The pieces concatenate to the
    non-streamed call's ``arguments``.
    """
    HOLD = len("}\n" + CLOSE) + 2

    def __init__(self, setup: ToolSetup):
        self.setup = setup
        self.buffer = ""
        self.calls = 0          # calls started so far (the next one's index)
        self.open = None        # the call being streamed: {"index", "id", "sent"} once its name is known

    def feed(self, delta: str, finished: bool) -> tuple[str, list[ToolCallDelta]]:
        self.buffer += delta
        content = ""
        calls: list[ToolCallDelta] = []
        while True:
            start = self.buffer.find(OPEN)
            if start < 0:
                keep = 0 if finished else _partial_prefix(self.buffer, OPEN)
                content += self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return content, calls
            content += self.buffer[:start]
            self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end < 0:
                if finished:   # an unclosed block: the model never finished its call
                    content, self.buffer = content + self.buffer, ""
                else:
                    calls += self._progress(self.buffer[len(OPEN):])
                return content, calls
            block = self.buffer[:end + len(CLOSE)]
            self.buffer = self.buffer[end + len(CLOSE):]
            text, done = self._close(block)
            content += text
            calls += done

    def _progress(self, body: str) -> list[ToolCallDelta]:
        """Deltas for an open block: its header once the name is known, then new argument text."""
        out: list[ToolCallDelta] = []
        if self.open is None:
            header = HEADER.match(body)
            if not header or json.loads(f'"{header.group(1)}"') not in self.setup.names:
                return out
            self.open = {"index": self.calls, "id": f"call_{uuid.uuid4().hex[:24]}", "sent": "",
                         "start": header.end()}
            self.calls += 1
            named: ToolCallDelta = {"index": self.open["index"], "id": self.open["id"], "type": "function",
                                    "function": {"name": json.loads(f'"{header.group(1)}"'), "arguments": ""}}
            out.append(named)
        ready = body[self.open["start"]:len(body) - self.HOLD]
        if len(ready) > len(self.open["sent"]):
            more: ToolCallDelta = {"index": self.open["index"],
                                   "function": {"arguments": ready[len(self.open["sent"]):]}}
            out.append(more)
            self.open["sent"] = ready
        return out

    def _close(self, block: str) -> tuple[str, list[ToolCallDelta]]:
        """(content, deltas) that finish a block: the rest of its arguments, the whole call if nothing
        was sent yet, or the block as content when it is no call."""
        opened, self.open = self.open, None
        body = block[len(OPEN):-len(CLOSE)]
        call = _call(body, self.setup)
        if opened is None:
            if call is None:
                return block, []
            self.calls += 1
            return "", [{"index": self.calls - 1, **call}]
        arguments = call["function"]["arguments"] if call else body[opened["start"]:].rstrip()[:-1]
        rest = arguments[len(opened["sent"]):] if arguments.startswith(opened["sent"]) else ""
        return "", [{"index": opened["index"], "function": {"arguments": rest}}] if rest else []


def _partial_prefix(text: str, word: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``word``."""
    for n in range(min(len(word) - 1, len(text)), 0, -1):
        if text.endswith(word[:n]):
            return n
    return 0
