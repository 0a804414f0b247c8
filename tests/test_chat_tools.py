"""Tool calls in each family's own format, on the family's real chat template (tests/data/chat_templates/).

The engine is made to emit an exact reply in the family's format (support.chat_families.scripted) and the API
must return it as OpenAI tool calls, whole and streamed alike; a forced call (tool_choice required) is
constrained to the family's format, so the scripted call's every token must be one its grammar allowed.
"""
from __future__ import annotations

import json

import openai
import pytest
from support.chat_families import FamilyServers, reply_ids, scripted, template

from lmport import tool_parsers
from lmport.reasoning.harmony import HarmonyTags
from lmport.server import tools
from lmport.tool_parsers.formats import FORMATS, Unconstrainable

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string"}, "days": {"type": "integer"}},
                                                "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a zone", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]

# (family template, the format it teaches, the call get_weather(city="Paris") as the family writes it)
CALLS = {
    "qwen3": ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    "llama3": ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    "mistral": ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]'),
    "deepseek_r1": ("deepseek_v3", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n'
                                   '```json\n{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "deepseek_v3": ("deepseek_v31", '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>'
                                    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    "qwen3_coder": ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
                                   "</function>\n</tool_call>"),
    "glm45": ("glm45", "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    "gpt_oss": ("harmony", "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
                           "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
                           '{"city": "Paris"}<|call|>'),
}


@pytest.fixture(scope="module")
def servers():
    made = FamilyServers()
    yield made
    made.close()


@pytest.mark.parametrize("family", sorted(CALLS))
def test_the_template_chooses_its_familys_format(family):
    assert tool_parsers.for_template(template(family)) == CALLS[family][0]


def _client(thread) -> openai.OpenAI:
    return openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _call_both_ways(thread, engine, reply: str, **kwargs):
    """(the whole reply's message and finish reason, the streamed calls joined by index, streamed content,
    forbidden tokens)."""
    client = _client(thread)
    with scripted(engine, reply_ids(engine, reply)) as script:
        whole = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=96, **kwargs)
        calls: dict[int, dict] = {}
        content, finish = [], None
        for chunk in client.chat.completions.create(model="tiny", messages=ASK, max_tokens=96, stream=True,
                                                    **kwargs):
            for choice in chunk.choices:
                content.append(choice.delta.content or "")
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"name": "", "arguments": ""})
                    call["name"] += delta.function.name or ""
                    call["arguments"] += delta.function.arguments or ""
    return whole.choices[0], calls, "".join(content), finish, script.forbidden


@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_call_in_the_familys_format_comes_back_as_a_tool_call(servers, family):
    thread, engine = servers(family)
    choice, streamed, content, finish, _ = _call_both_ways(thread, engine, CALLS[family][1], tools=[WEATHER, TIME])
    assert choice.finish_reason == finish == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert choice.message.content is None and content == ""
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [("get_weather", {"city": "Paris"})]


@pytest.mark.parametrize("family", sorted(CALLS))
def test_a_forced_call_is_constrained_to_the_familys_format(servers, family):
    thread, engine = servers(family)
    choice, streamed, _, _, forbidden = _call_both_ways(thread, engine, CALLS[family][1], tools=[WEATHER, TIME],
                                                        tool_choice="required")
    assert forbidden == []   # every token of the family's call was one the forced grammar allowed
    assert choice.message.tool_calls[0].function.name == "get_weather" and len(streamed) == 1


def test_the_forced_grammar_refuses_another_familys_call(servers):
    thread, engine = servers("llama3")
    with scripted(engine, reply_ids(engine, CALLS["mistral"][1])) as script:
        _client(thread).chat.completions.create(model="tiny", messages=ASK, max_tokens=48, tools=[WEATHER],
                                                tool_choice="required")
    assert script.forbidden and script.forbidden[0][0] == 0


EITHER = {"type": "function", "function": {"name": "set_value", "parameters": {"type": "object", "properties": {
    "value": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}, "required": ["value"]}}}


@pytest.mark.parametrize("family", ["qwen3_coder", "glm45"])
def test_a_forced_call_whose_parameter_the_format_cannot_state_is_refused_naming_it(servers, family):
    """These formats write a string parameter as bare text and others as JSON: a value that may be either has
    no one form, so forcing the call is refused rather than constrained to something the reader misreads."""
    thread, _ = servers(family)
    with pytest.raises(openai.BadRequestError) as caught:
        _client(thread).chat.completions.create(model="tiny", messages=ASK, max_tokens=8, tools=[EITHER],
                                                tool_choice="required")
    assert caught.value.body["param"] == "tool_choice" and "set_value.value" in caught.value.body["message"]


@pytest.mark.parametrize("family", sorted(CALLS))
def test_the_call_goes_back_through_the_familys_template(servers, family):
    """The reply's call and a tool result, sent back as the next turn's history, render through the template
    (Mistral's requires 9-character call ids, which its calls get)."""
    thread, engine = servers(family)
    client = _client(thread)
    with scripted(engine, reply_ids(engine, CALLS[family][1])):
        first = client.chat.completions.create(model="tiny", messages=ASK, max_tokens=96, tools=[WEATHER])
    call = first.choices[0].message.tool_calls[0]
    history = [*ASK, first.choices[0].message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    with scripted(engine, reply_ids(engine, "Sunny.")):
        second = client.chat.completions.create(model="tiny", messages=history, max_tokens=8, tools=[WEATHER])
    assert second.choices[0].message.content == "Sunny."


def test_parallel_tool_calls_false_keeps_the_first_call(servers):
    thread, engine = servers("qwen3")
    two = CALLS["qwen3"][1] + '\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    choice, streamed, _, _, _ = _call_both_ways(thread, engine, two, tools=[WEATHER, TIME])
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather", "get_time"] and len(streamed) == 2
    choice, streamed, _, _, _ = _call_both_ways(thread, engine, two, tools=[WEATHER, TIME], parallel_tool_calls=False)
    assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"] and len(streamed) == 1


def test_a_tool_call_parser_flag_overrides_the_template(servers):
    thread, engine = servers("llama3", tool_call_parser="pythonic")
    choice, streamed, _, _, _ = _call_both_ways(thread, engine, '[get_weather(city="Paris", days=2)]',
                                                tools=[WEATHER])
    assert json.loads(choice.message.tool_calls[0].function.arguments) == {"city": "Paris", "days": 2}
    assert list(streamed.values())[0]["name"] == "get_weather"


# -- response_format beside tools -----------------------------------------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


def test_a_forced_call_comes_after_the_thinking(servers):
    thread, engine = servers("qwen3")
    choice, _, _, _, forbidden = _call_both_ways(thread, engine, "<think>\nI need the weather.\n</think>\n\n"
                                                 + CALLS["qwen3"][1], tools=[WEATHER], tool_choice="required")
    assert forbidden == []   # the thinking was free; the call (the first token after it too) was constrained
    message = choice.message.model_dump()
    assert message["reasoning_content"] == "\nI need the weather.\n"
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"


def test_a_forced_call_with_a_response_format_is_a_call(servers):
    """OpenAI applies response_format to text replies: a forced call's turn is the call."""
    thread, engine = servers("qwen3")
    choice, _, _, _, forbidden = _call_both_ways(thread, engine, CALLS["qwen3"][1], tools=[WEATHER],
                                                 tool_choice="required", response_format=FORMAT)
    assert forbidden == [] and choice.message.tool_calls[0].function.name == "get_weather"


@pytest.mark.parametrize("reply, called", [(CALLS["qwen3"][1], True), ('{"a": 1}', False)])
def test_with_tool_choice_auto_the_reply_is_a_call_or_the_formats_json(servers, reply, called):
    thread, engine = servers("qwen3")
    choice, _, _, _, forbidden = _call_both_ways(thread, engine, reply, tools=[WEATHER], response_format=FORMAT)
    assert forbidden == []
    assert bool(choice.message.tool_calls) is called
    if not called:
        assert json.loads(choice.message.content) == {"a": 1}


def test_with_tool_choice_auto_the_grammar_still_refuses_other_text(servers):
    thread, engine = servers("qwen3")
    with scripted(engine, reply_ids(engine, "Plain words.")) as script:
        _client(thread).chat.completions.create(model="tiny", messages=ASK, max_tokens=8, tools=[WEATHER],
                                                response_format=FORMAT)
    assert script.forbidden and script.forbidden[0][0] == 0


# -- the parsers on exact texts ------------------------------------------------------------------------------

OPTIONS = {"name": "options", "parameters": {"type": "object", "properties": {
    "verbose": {"type": "boolean"}, "unit": {"type": "string", "enum": ["c", "f"]}, "limit": {"type": "integer"}}}}
GRAMMAR_CALLS = [
    {"name": "get_weather", "arguments": {"city": "Paris"}},
    {"name": "get_weather", "arguments": {"city": "New York", "days": 3}},
    {"name": "options", "arguments": {}},
    {"name": "options", "arguments": {"unit": "f"}},
    {"name": "options", "arguments": {"verbose": True, "limit": 5}},
]
WRONG_CALLS = [
    {"name": "get_weather", "arguments": {"days": 3}},                    # the required city missing
    {"name": "get_weather", "arguments": {"city": "Paris", "days": "three"}},  # days not an integer
    {"name": "options", "arguments": {"unit": "k"}},                      # not one of the choices
    {"name": "get_time", "arguments": {"zone": "CET"}},                   # not a tool of this request
]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_formats_forced_grammar_takes_its_calls_and_nothing_else(name):
    """The grammar of a forced call accepts each call as the format renders it (optional parameters left out
    or given, in schema order) and refuses a call without a required parameter, with a wrong type, a value
    outside the choices, or to a function the request does not offer."""
    from xgrammar.testing import _is_grammar_accept_string
    fmt = FORMATS[name]
    grammar = fmt.grammar([WEATHER["function"], OPTIONS])
    for call in GRAMMAR_CALLS:
        text = _as_generated(fmt, call)
        assert _is_grammar_accept_string(grammar, text), text
        if fmt.spans_reasoning:   # the reply may think first
            assert _is_grammar_accept_string(grammar, "<|channel|>analysis<|message|>Think first.<|end|>"
                                                      "<|start|>assistant" + text)
            text = HarmonyTags().split(text, True)[1]   # the answer the harmony format reads
        read = fmt.read(text[fmt.start(text):], {**SCHEMAS, "options": OPTIONS["parameters"]})
        assert [(n, json.loads(a)) for n, a in read] == [(call["name"], call["arguments"])]
    for call in WRONG_CALLS:
        assert not _is_grammar_accept_string(grammar, _as_generated(fmt, call)), call


def _as_generated(fmt, call: dict) -> str:
    """One call as the model writes it: the format's rendering, or for harmony the message gpt-oss writes."""
    if fmt.name != "harmony":
        return fmt.render([call])
    return (f"<|channel|>commentary to=functions.{call['name']} <|constrain|>json<|message|>"
            f"{json.dumps(call['arguments'])}<|call|>")


@pytest.mark.parametrize("name, schema", [
    ("qwen3_coder", {"anyOf": [{"type": "string"}, {"type": "integer"}]}),
    ("glm45", {"type": "string", "pattern": "^[a-z]+$"}),
    ("pythonic", {"type": "object", "properties": {"on": {"type": "boolean"}}}),
    ("pythonic", {"type": "array", "items": {"type": "integer"}}),
])
def test_a_parameter_the_formats_text_cannot_state_is_named(name, schema):
    function = {"name": "f", "parameters": {"type": "object", "properties": {"x": schema}, "required": ["x"]}}
    with pytest.raises(Unconstrainable, match=r"f\.x: the \w+ format writes"):
        FORMATS[name].grammar([function])


SCHEMAS = {"get_weather": WEATHER["function"]["parameters"], "get_time": TIME["function"]["parameters"]}


@pytest.mark.parametrize("name, text, calls", [
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}',
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("mistral", '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', [("get_weather", {"city": "Paris"})]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', [("get_weather", {"city": "Paris"})]),
    ("mistral", 'Data: [{"a": 1}]', None),
    ("qwen3_coder", "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n<parameter=days>\n3\n"
                    "</parameter>\n</function>\n</tool_call>", [("get_weather", {"city": "42", "days": 3})]),
    ("pythonic", "[get_weather(city='Paris'), get_time(zone=\"CET\")]",
     [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})]),
    ("pythonic", "[get_weather('Paris')]", None),     # positional arguments name nothing
    ("llama3_json", '{"name": "get_weather", "parameters": [1]}', None),
])
def test_each_format_reads_its_calls(name, text, calls):
    fmt = FORMATS[name]
    found = fmt.read(text[fmt.start(text):], SCHEMAS) if fmt.start(text) is not None else None
    assert (found and [(n, json.loads(a)) for n, a in found]) == (calls or None)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_format_reads_what_it_renders(name):
    fmt = FORMATS[name]
    calls = [{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}]
    text = fmt.render(calls)
    assert fmt.start(text) is not None
    assert [(n, json.loads(a)) for n, a in fmt.read(text[fmt.start(text):], SCHEMAS)] == [
        ("get_weather", {"city": "Paris", "days": 2})]


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_streaming_in_any_two_pieces_gives_the_whole_reply(name):
    fmt = FORMATS[name]
    setup = tools.ToolSetup([WEATHER, TIME], ["get_weather", "get_time"], "auto", None, fmt)
    body = fmt.render([{"name": "get_weather", "arguments": {"city": "Paris"}}])
    for text in (body, ("" if fmt.at_start else "Let me look. ") + body, "No call here."):
        whole = tools.parse(text, setup)
        for cut in range(len(text) + 1):
            parser = tools.stream_parser(setup)
            a, b = parser.feed(text[:cut], False), parser.feed(text[cut:], True)
            got = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in a[1] + b[1]]
            assert got == [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in whole[1]], cut
            assert (a[0] + b[0]).strip() == (whole[0] or ""), cut
