"""The messages between the front end and the engine core: plain msgpack that round-trips every field."""
from __future__ import annotations

from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, FinishReason, RequestOutput
from lmport.engine.messages import (EngineRequest, adapter_from_wire, adapter_to_wire, error_from_wire, error_to_wire,
                                    output_from_wire, output_to_wire, pack, unpack)
from lmport.lora import AdapterError
from lmport.lora.table import LoadedAdapter


def test_a_request_round_trips_with_every_generation_field():
    config = GenerationConfig(max_new_tokens=7, temperature=0.5, do_sample=True, random_seed=3, stop_words=["x"],
                              logprobs=2, logit_bias={5: -100.0, 17: 2.5}, prompt_logprobs=1,
                              response_format={"type": "json_object"}, stop_token_ids=[1, 2], speculate=False)
    request = EngineRequest("r-1", [1, 2, 3], config, cache_salt="s", adapter="sql", pooling="mean")
    data = pack(["add", request.to_wire()])
    assert isinstance(data, bytes)
    kind, wire = unpack(data)
    assert kind == "add" and EngineRequest.from_wire(wire) == request


def test_an_output_round_trips_as_its_token_deltas():
    out = RequestOutput("r-1", [], "", [5], "", True, "stop", 3, cached_tokens=2, error=None,
                        delta_logprobs=[{5: -0.25, 9: -2.0}], prompt_logprobs=[{2: -1.5}, {3: -0.5}])
    back = output_from_wire(unpack(pack(output_to_wire(out))))
    assert back == out


def test_a_failed_output_keeps_its_reason_and_whose_fault_it_is():
    """The finish reason and the error's kind cross as their strings and come back as the enums, so a format's
    failure is still the request's fault (a 400) on the front end's side."""
    out = RequestOutput("r-2", [], "", [], "", True, FinishReason.ERROR, 3, error="response_format: dead end",
                        error_kind=ErrorKind.REQUEST)
    wire = unpack(pack(output_to_wire(out)))
    assert "error" in wire and "request" in wire   # plain strings on the wire
    back = output_from_wire(wire)
    assert back == out and back.finish_reason is FinishReason.ERROR and back.request_fault
    engine_fault = RequestOutput("r-3", [], "", [], "", True, FinishReason.ERROR, 3, error="forward failed",
                                 error_kind=ErrorKind.ENGINE)
    assert not output_from_wire(unpack(pack(output_to_wire(engine_fault)))).request_fault


def test_an_embedding_output_carries_its_vector():
    out = RequestOutput("e-1", [], "", [], "", True, "stop", 4, embedding=[0.25, -1.0, 3.5])
    assert output_from_wire(unpack(pack(output_to_wire(out)))).embedding == [0.25, -1.0, 3.5]


def test_adapters_and_errors_cross_as_plain_values():
    adapter = LoadedAdapter("sql", 1, 0, "/adapters/sql", 8, created=1700000000)
    assert adapter_from_wire(unpack(pack([adapter_to_wire(adapter)]))[0]) == adapter
    error = error_from_wire(unpack(pack([error_to_wire(AdapterError("no room", "lora_name", 409))]))[0])
    assert isinstance(error, AdapterError) and (str(error), error.param, error.status) == ("no room", "lora_name", 409)
    assert str(error_from_wire(error_to_wire(KeyError("x")))) == "KeyError: 'x'"
