"""Constrained decoding in the engine: a random-weight model's output follows the grammar; grammars are cached."""
from __future__ import annotations

import contextlib
import functools
import json
import re

import jsonschema
import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.entrypoints.cli import build_parser, gen_config
from lmport.config import ConfigError
from lmport.engine.engine import RequestError
from lmport.structured_output import grammar as guided
from lmport.structured_output.grammar import apply_bitmask
from support.model_helpers import tiny_model_dir

SCHEMA = {"type": "object", "properties": {
    "kind": {"type": "string", "enum": ["cat", "dog"]}, "legs": {"type": "integer", "minimum": 0, "maximum": 8},
    "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}, "required": ["kind", "legs", "tags"]}


@functools.cache
def tiny_pipe():
    return lmport.pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        device_type="cpu", cache_max_entry_count=64, session_len=512))


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_random_model_follows_schema_regex_and_grammar_in_one_batch():
    pipe = tiny_pipe()
    engine = pipe.engine
    formats = [{"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}},
               {"type": "regex_schema", "regex_schema": "[a-c]{2}-[0-9]{2}"},
               {"type": "grammar", "grammar": 'root ::= "yes" | "no"'},
               None]
    rids = {engine.add_request(ids(10, i), GenerationConfig(max_new_tokens=60, response_format=f, do_sample=True,
                                                            random_seed=i)): i
            for i, f in enumerate(formats)}
    done = {}
    while len(done) < len(rids):
        for out in engine.step():
            if out.finished:
                done[rids[out.request_id]] = out
    jsonschema.validate(json.loads(done[0].text), SCHEMA)
    assert re.fullmatch("[a-c]{2}-[0-9]{2}", done[1].text)
    assert done[2].text in ("yes", "no")
    assert all(done[i].finish_reason == "stop" for i in range(3))
    assert done[3].finish_reason == "length"   # the unconstrained random row never ends on its own


def test_each_distinct_format_compiles_once():
    engine = tiny_pipe().engine
    fmt = {"type": "regex_schema", "regex_schema": "(x|y){3}"}
    before = engine.grammars.compiles
    outs = tiny_pipe().generate([ids(5, 1), ids(6, 2), ids(7, 3)], GenerationConfig(max_new_tokens=8,
                                                                                   response_format=fmt))
    assert [o.finish_reason for o in outs] == ["stop"] * 3 and all(re.fullmatch("(x|y){3}", o.text) for o in outs)
    assert engine.grammars.compiles == before + 1


def test_length_cut_and_bad_formats():
    out = tiny_pipe().generate([ids(5, 4)], GenerationConfig(max_new_tokens=3, response_format={
        "type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": {
            "s": {"type": "string", "minLength": 30}}, "required": ["s"]}}}))[0]
    assert out.finish_reason == "length" and out.text.startswith("{")
    with pytest.raises(ConfigError, match="response_format must be an object whose type is one of"):
        GenerationConfig(response_format={"type": "yaml"})
    with pytest.raises(ConfigError, match="not a valid JSON schema"):
        GenerationConfig(response_format={"type": "json_schema", "json_schema": {"schema": {"type": 3}}})
    # A string literal never closed: no grammar parser takes it. lmport's words, not the grammar engine's reason.
    with pytest.raises(RequestError, match="^response_format: the grammar cannot be compiled: "):
        tiny_pipe().engine.add_request([1, 2], GenerationConfig(response_format={"type": "grammar",
                                                                                 "grammar": 'root ::= "a'}))
    assert not tiny_pipe().engine.has_unfinished()


@pytest.mark.parametrize("kernel_devices", [("cpu", "cuda"), ()], ids=["kernel", "torch"])
def test_bitmask_bits_select_tokens(monkeypatch, kernel_devices):
    monkeypatch.setattr(guided, "KERNEL_DEVICES", kernel_devices)
    logits = torch.zeros(3, 70)
    bitmask = torch.zeros(3, 3, dtype=torch.int32)
    bitmask[0, 0] = 0b101          # tokens 0 and 2
    bitmask[1] = -1                # row 1 is not in rows: untouched anyway
    bitmask[2, 2] = 1 << 5         # token 69
    out = apply_bitmask(logits, [0, 2], bitmask)
    assert torch.isfinite(out[0]).nonzero().flatten().tolist() == [0, 2]
    assert torch.isfinite(out[1]).all()
    assert torch.isfinite(out[2]).nonzero().flatten().tolist() == [69]
    assert torch.isfinite(logits).all()   # the caller's logits are left as they were


def test_cli_takes_response_format_as_json():
    args = build_parser().parse_args(["generate", "hi", "--response-format", '{"type": "json_object"}'])
    assert gen_config(args).response_format == {"type": "json_object"}


BOUNDED = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
           "additionalProperties": False}


def matches(matcher, text: str) -> bool:
    return matcher.matcher.accept_string(text) and matcher.matcher.is_completed()


def test_a_length_bounded_string_admits_no_raw_control_character():
    # xgrammar 0.2 compiles maxLength to a class that let "\x10" through: outputs that finished "stop" did not parse
    grammars = tiny_pipe().engine.grammars
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": BOUNDED}}
    assert matches(grammars.matcher(fmt), '{"name": "kk wickedoj"}')
    for bad in ('{"name": "kk wickedoj\x10"}', '{"name": "a\tb"}', '{"name": "abcdefghijklm"}'):
        assert not matches(grammars.matcher(fmt), bad), bad
        with pytest.raises(json.JSONDecodeError) if "\x10" in bad or "\t" in bad else contextlib.nullcontext():
            json.loads(bad)


def test_a_forced_tool_call_admits_no_raw_control_character():
    from lmport.server.tools import call_grammar
    grammars = tiny_pipe().engine.grammars
    fn = {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16}}, "required": ["city"]}}
    fmt = {"type": "grammar", "grammar": call_grammar([fn])}
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    assert matches(grammars.matcher(fmt), call % "Paris")
    assert not matches(grammars.matcher(fmt), call % "__Qtpersonswort\x0b")


def test_a_length_beside_a_pattern_is_refused_not_dropped():
    with pytest.raises(guided.GuidedDecodingError, match="maxLength beside pattern"):
        guided.check_schema({"type": "string", "pattern": "^[a-z]*$", "maxLength": 4})
    with pytest.raises(guided.GuidedDecodingError, match="minLength beside format"):
        guided.check_schema({"type": "string", "format": "email", "minLength": 4})
