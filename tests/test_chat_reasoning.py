"""Reasoning apart from the answer, on each family's real chat template (tests/data/chat_templates/).

The engine is made to emit an exact reply (support.chat_families.scripted: the family's own thinking markers,
then the answer) and the API must return the thinking as ``reasoning_content`` / ``reasoning`` and the rest as
the answer, whole and streamed alike. A structured output constrains the answer only: the scripted reply's
tokens must be what the grammar's masks allowed.
"""
from __future__ import annotations

import json

import openai
import pytest
from support.chat_families import FamilyServers, family_model_dir, reply_ids, scripted, template

from lmport import reasoning

HI = [{"role": "user", "content": "Hi"}]


# -- the parser each template gets, and where its reply starts --------------------------------------------

@pytest.mark.parametrize("family, parser", [("qwen3", "qwen3"), ("deepseek_r1", "deepseek_r1"), ("glm45", "glm45"),
                                            ("gpt_oss", "harmony"), ("llama3", None), ("mistral", None)])
def test_the_template_chooses_its_familys_parser(family, parser):
    chosen = reasoning.for_template(template(family))
    assert (chosen and chosen.name) == parser


def _rendered(family: str, **kwargs) -> str:
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(family_model_dir())
    tok.chat_template = template(family)
    return tok.apply_chat_template(HI, tokenize=False, add_generation_prompt=True, **kwargs)


@pytest.mark.parametrize("family, kwargs, inside", [
    ("qwen3", {}, False),                              # the reply opens <think> itself
    ("qwen3", {"enable_thinking": False}, False),      # an empty block closed in the prompt
    ("deepseek_r1", {"enable_thinking": True}, True),  # the template opens the block for the reply
    ("deepseek_r1", {}, False),                        # ... and closes it when thinking is not asked for
    ("glm45", {}, False),
    ("glm45", {"enable_thinking": False}, False),
    ("deepseek_v3", {}, False),                        # V3.1: <think></think>, thinking off
    ("deepseek_v3", {"thinking": True}, True),
    ("gpt_oss", {}, True),                             # a harmony reply begins with its header
])
def test_the_prompt_says_whether_the_reply_starts_inside_the_thinking(family, kwargs, inside):
    parser = reasoning.for_template(template(family))
    assert parser is not None and parser.starts_inside(_rendered(family, **kwargs)) is inside


@pytest.mark.parametrize("parser, before, thinking, after, inside", [
    ("qwen3", "<think>", "\nThe user greets me.\n", "</think>\n\nHello there.", False),
    ("deepseek_r1", "", "Let me think: 2 + 2 is 4.", "</think>\n\nFour.", True),
    ("qwen3", "", "", "Hello there.", False),
    ("qwen3", "<think>", "cut off by the length limit", "", False),
    ("harmony", "<|channel|>analysis<|message|>", "The user greets me.",
     "<|end|><|start|>assistant<|channel|>final<|message|>Hello.<|return|>", True),
])
def test_reasoning_tokens_are_the_tokens_of_the_thinking(parser, before, thinking, after, inside):
    """The markers are tokens of their own in the families' tokenizers, so the thinking's tokens are those of
    its text alone."""
    from support.chat_families import family_model_dir

    from lmport.models.loader import load_tokenizer
    tokenizer = load_tokenizer(family_model_dir())
    ids = [tokenizer.encode(part, add_special_tokens=False) for part in (before, thinking, after)]
    counted = reasoning.Reasoning(reasoning.PARSERS[parser], inside).token_count(sum(ids, []), tokenizer)
    assert counted == len(ids[1])


@pytest.mark.parametrize("parser, text, inside, expected", [
    ("qwen3", "<think>\nhmm\n</think>\n\nHello", False, ("\nhmm\n", "Hello")),
    ("qwen3", "Hello <think>not a block</think>", False, (None, "Hello <think>not a block</think>")),
    ("qwen3", "hmm</think>\n\nHi", True, ("hmm", "Hi")),
    ("qwen3", "<think>hmm</think>Hi", True, ("hmm", "Hi")),         # a repeated opening tag is not thinking text
    ("qwen3", "cut off by the length limit", True, ("cut off by the length limit", "")),
    ("harmony", "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant<|channel|>final<|message|>Hi<|return|>",
     True, ("hmm", "Hi")),
    ("harmony", "<|channel|>analysis<|message|>hmm<|end|><|start|>assistant to=functions.f<|channel|>commentary "
                'json<|message|>{"a": 1}<|call|>', True, ("hmm", '<|channel|>commentary to=functions.f<|message|>'
                                                                '{"a": 1}<|call|>')),
    ("harmony", "<|channel|>analysis<|message|>cut off", True, ("cut off", "")),
])
def test_split_whole_and_every_two_piece_stream_agree(parser, text, inside, expected):
    tags = reasoning.PARSERS[parser]
    assert tags.split(text, inside) == expected
    for cut in range(len(text) + 1):
        splitter = tags.splitter(inside)
        a = splitter.feed(text[:cut], False)
        b = splitter.feed(text[cut:], True)
        assert (a[0] + b[0], a[1] + b[1]) == ((expected[0] or ""), expected[1]), cut


# -- over the API ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def servers():
    made = FamilyServers()
    yield made
    made.close()


_ids = reply_ids


def _client(thread) -> openai.OpenAI:
    return openai.OpenAI(base_url=thread.url + "/v1", api_key="none", max_retries=0, timeout=120)


def _ask(thread, engine, reply: str, **kwargs):
    """(the whole message, the streamed reasoning and content joined, the forbidden tokens) for ``reply``."""
    client = _client(thread)
    with scripted(engine, _ids(engine, reply)) as script:
        whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=64, **kwargs)
        thought, content = [], []
        for chunk in client.chat.completions.create(model="tiny", messages=HI, max_tokens=64, stream=True,
                                                    **kwargs):
            for choice in chunk.choices:
                delta = choice.delta.model_dump()
                assert delta.get("reasoning") == delta.get("reasoning_content")
                thought.append(delta.get("reasoning_content") or "")
                content.append(delta.get("content") or "")
    return whole, "".join(thought), "".join(content), script.forbidden


@pytest.mark.parametrize("family, reply, kwargs, expected", [
    ("qwen3", "<think>\nThe user greets me.\n</think>\n\nHello there.", {},
     ("\nThe user greets me.\n", "Hello there.")),
    ("qwen3", "Hello there.", {"enable_thinking": False}, (None, "Hello there.")),
    ("deepseek_r1", "Let me think.\n</think>\n\nThe answer.", {"enable_thinking": True},
     ("Let me think.\n", "The answer.")),
    ("glm45", "<think>hmm</think>\nHi!", {}, ("hmm", "Hi!")),
    ("gpt_oss", "<|channel|>analysis<|message|>Think first.<|end|><|start|>assistant<|channel|>final<|message|>"
                "Hello.<|return|>", {}, ("Think first.", "Hello.")),
    ("gpt_oss", "<|channel|>final<|message|>Hello.<|return|>", {}, (None, "Hello.")),
])
def test_reasoning_comes_apart_whole_and_streamed(servers, family, reply, kwargs, expected):
    thread, engine = servers(family)
    extra = {"chat_template_kwargs": kwargs} if kwargs else {}
    whole, thought, content, _ = _ask(thread, engine, reply, extra_body=extra)
    message = whole.choices[0].message.model_dump()
    assert (message["reasoning_content"], message["content"]) == expected
    assert message["reasoning"] == expected[0]
    assert (thought, content) == (expected[0] or "", expected[1])
    assert whole.usage.completion_tokens == len(_ids(engine, reply))   # max_tokens counts thinking and answer


def test_chat_template_kwargs_reach_the_template(servers):
    from transformers import AutoTokenizer
    thread, engine = servers("qwen3")
    tok = AutoTokenizer.from_pretrained(family_model_dir())
    tok.chat_template = template("qwen3")
    for kwargs in ({}, {"enable_thinking": False}):
        with scripted(engine, _ids(engine, "Hi")):
            reply = _client(thread).chat.completions.create(model="tiny", messages=HI, max_tokens=8,
                                                            extra_body={"chat_template_kwargs": kwargs})
        assert reply.usage.prompt_tokens == len(tok.apply_chat_template(HI, add_generation_prompt=True,
                                                                       return_dict=False, **kwargs))


def test_a_template_argument_the_server_sets_is_refused(servers):
    thread, _ = servers("qwen3")
    with pytest.raises(openai.BadRequestError) as caught:
        _client(thread).chat.completions.create(model="tiny", messages=HI, max_tokens=8,
                                                extra_body={"chat_template_kwargs": {"tools": []}})
    assert caught.value.body["param"] == "chat_template_kwargs"


def test_include_reasoning_false_leaves_the_thinking_out(servers):
    thread, engine = servers("qwen3")
    whole, thought, content, _ = _ask(thread, engine, "<think>x</think>Hi", extra_body={"include_reasoning": False})
    message = whole.choices[0].message.model_dump()
    assert message["content"] == "Hi" and message.get("reasoning_content") is None and thought == ""


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}}


@pytest.mark.parametrize("family, reply, kwargs, thought", [
    ("qwen3", '<think>\nnot JSON {\n</think>{"a": 1}', {}, "\nnot JSON {\n"),
    ("deepseek_r1", 'free text: [[</think>{"a": 1}', {"enable_thinking": True}, "free text: [["),
    ("gpt_oss", '<|channel|>analysis<|message|>free {<|end|><|start|>assistant<|channel|>final<|message|>{"a": 1}'
                '<|return|>', {}, "free {"),
])
def test_a_structured_output_constrains_only_the_answer(servers, family, reply, kwargs, thought):
    thread, engine = servers(family)
    whole, streamed_thought, content, forbidden = _ask(thread, engine, reply, response_format=FORMAT,
                                                       extra_body={"chat_template_kwargs": kwargs})
    assert forbidden == []   # every scripted token, thinking and JSON, was allowed by the masks
    message = whole.choices[0].message
    assert json.loads(message.content) == {"a": 1} and content == message.content
    assert message.model_dump()["reasoning_content"] == thought == streamed_thought


def test_after_the_thinking_the_grammar_refuses_what_the_schema_does_not_allow(servers):
    thread, engine = servers("qwen3")
    reply = "<think>ok</think>not JSON"
    with scripted(engine, _ids(engine, reply)) as script:
        _client(thread).chat.completions.create(model="tiny", messages=HI, max_tokens=32, response_format=FORMAT)
    after = len(engine.tokenizer.encode("<think>ok</think>", add_special_tokens=False))
    assert script.forbidden and script.forbidden[0][0] == after   # the first answer token, none before it


# -- Anthropic's thinking blocks and the Responses API's reasoning items -------------------------------------

QWEN3_REPLY = "<think>\nThe user greets me.\n</think>\n\nHello there."


def test_anthropic_messages_give_the_thinking_as_a_thinking_block(servers):
    import anthropic
    thread, engine = servers("qwen3")
    client = anthropic.Anthropic(base_url=thread.url, api_key="none", max_retries=0)
    with scripted(engine, _ids(engine, QWEN3_REPLY)):
        whole = client.messages.create(model="tiny", max_tokens=64, messages=HI)
        with client.messages.stream(model="tiny", max_tokens=64, messages=HI) as stream:
            streamed = stream.get_final_message()
    for message in (whole, streamed):
        assert [b.type for b in message.content] == ["thinking", "text"]
        assert message.content[0].thinking == "\nThe user greets me.\n"
        assert message.content[1].text == "Hello there."


def test_responses_give_the_thinking_as_a_reasoning_item(servers):
    thread, engine = servers("qwen3")
    client = _client(thread)
    with scripted(engine, _ids(engine, QWEN3_REPLY)):
        whole = client.responses.create(model="tiny", input="Hi", max_output_tokens=64)
        events = list(client.responses.create(model="tiny", input="Hi", max_output_tokens=64, stream=True))
    streamed = events[-1].response
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert deltas == "\nThe user greets me.\n"
    thinking = len(engine.tokenizer.encode("\nThe user greets me.\n", add_special_tokens=False))
    for response in (whole, streamed):
        assert [item.type for item in response.output] == ["reasoning", "message"]
        assert response.output[0].content[0].text == "\nThe user greets me.\n"
        assert response.output_text == "Hello there."
        assert response.usage.output_tokens_details.reasoning_tokens == thinking
    # a client sends the output back with the next turn: the reasoning item is accepted (and left out)
    with scripted(engine, _ids(engine, "Fine.")):
        nxt = client.responses.create(model="tiny", max_output_tokens=8, input=[
            {"role": "user", "content": "Hi"}, *[item.model_dump(exclude_none=True) for item in whole.output],
            {"role": "user", "content": "How are you?"}])
    assert nxt.output_text == "Fine."


def test_lmport_chat_shows_the_thinking_apart_from_the_reply(servers):
    from lmport.entrypoints.chat import _remote_stream
    from lmport.config import GenerationConfig
    thread, engine = servers("qwen3")
    thinking: list[str] = []
    stream = _remote_stream(thread.url, "none", GenerationConfig(max_new_tokens=64), on_thinking=thinking.append)
    with scripted(engine, _ids(engine, QWEN3_REPLY)):
        reply = "".join(stream(HI))
    assert reply == "Hello there." and "".join(thinking) == "\nThe user greets me.\n"
