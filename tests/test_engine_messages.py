"""The messages between the front end and the engine core: typed msgpack that round-trips every field, refuses a
message of another shape by the field that does not fit, and tells a core of another protocol apart."""
from __future__ import annotations

import msgspec
import numpy as np
import pytest

from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, FinishReason, RequestError, RequestOutput
from lmport.engine.messages import (PROTOCOL, Abort, Add, Call, EngineInfo, EngineRequest, Failed, OutputDelta,
                                    Outputs, ProtocolMismatch, Ready, Rejected, Reply, Shutdown, WireError, pack,
                                    ready, to_core, to_front_end, unpack)
from lmport.lora import AdapterError
from lmport.lora.table import LoadedAdapter
from lmport.multimodal.inputs import ImageInput

INFO = EngineInfo("m", 100, 64, 1024, [2], 8, 512, 40, "cpu", "float32", 8)


def _round_trip(out: RequestOutput) -> RequestOutput:
    message = to_front_end(pack(Outputs([OutputDelta.of(out)], {"running": 1}, None)))
    assert isinstance(message, Outputs)
    return message.outputs[0].output()


def test_a_request_round_trips_with_every_generation_field():
    config = GenerationConfig(max_new_tokens=7, temperature=0.5, do_sample=True, random_seed=3, stop_words=["x"],
                              logprobs=2, logit_bias={5: -100.0, 17: 2.5}, prompt_logprobs=1,
                              response_format={"type": "json_object"}, stop_token_ids=[1, 2], speculate=False)
    request = EngineRequest("r-1", [1, 2, 3], config, cache_salt="s", adapter="sql", pooling="mean", group="job")
    message = to_core(pack(Add(request)))
    assert isinstance(message, Add) and message.request == request


def test_a_request_with_images_carries_their_pixels_as_float32_bytes():
    pixels = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    image = ImageInput(4, 6, (1, 4, 6), "d" * 32, pixels)
    message = to_core(pack(Add(EngineRequest("r-1", [1] * 12, images=[image]))))
    assert isinstance(message, Add) and message.request.images is not None
    back = message.request.images[0]
    assert (back.offset, back.num_tokens, back.grid_thw, back.digest) == (4, 6, (1, 4, 6), "d" * 32)
    assert back.pixel_values is not None and back.pixel_values.dtype == np.float32
    assert np.array_equal(back.pixel_values, pixels)


def test_each_control_message_round_trips():
    for message in (Abort("r-1"), Call(3, "load_adapter", ["sql", "/adapters/sql"]), Shutdown()):
        assert to_core(pack(message)) == message


def test_an_output_round_trips_as_its_token_deltas():
    out = RequestOutput("r-1", [], "", [5], "", True, FinishReason.STOP, 3, cached_tokens=2, error=None,
                        delta_logprobs=[{5: -0.25, 9: -2.0}], prompt_logprobs=[{2: -1.5}, {3: -0.5}])
    assert _round_trip(out) == out


def test_a_failed_output_keeps_its_reason_and_whose_fault_it_is():
    """The finish reason and the error's kind cross as their strings and come back as the enums, so a format's
    failure is still the request's fault (a 400) on the front end's side."""
    out = RequestOutput("r-2", [], "", [], "", True, FinishReason.ERROR, 3, error="response_format: dead end",
                        error_kind=ErrorKind.REQUEST)
    wire = msgspec.msgpack.decode(pack(OutputDelta.of(out)))
    assert "error" in wire and "request" in wire   # plain strings on the wire
    back = _round_trip(out)
    assert back == out and back.finish_reason is FinishReason.ERROR and back.request_fault
    engine_fault = RequestOutput("r-3", [], "", [], "", True, FinishReason.ERROR, 3, error="forward failed",
                                 error_kind=ErrorKind.ENGINE)
    assert not _round_trip(engine_fault).request_fault


def test_an_embedding_output_carries_its_vector():
    out = RequestOutput("e-1", [], "", [], "", True, FinishReason.STOP, 4, embedding=[0.25, -1.0, 3.5])
    assert _round_trip(out).embedding == [0.25, -1.0, 3.5]


def test_adapters_and_errors_cross_as_their_types():
    adapter = LoadedAdapter("sql", 1, 0, "/adapters/sql", 8, created=1700000000)
    assert to_front_end(pack(Reply(4, adapter, None))) == Reply(4, adapter, None)
    message = to_front_end(pack(Reply(5, None, WireError.of(AdapterError("no room", "lora_name", 409)))))
    assert isinstance(message, Reply) and message.error is not None
    error = message.error.exception()
    assert isinstance(error, AdapterError) and (str(error), error.param, error.status) == ("no room", "lora_name", 409)
    rejected = to_front_end(pack(Rejected("r-1", WireError.of(RequestError("too long")))))
    assert isinstance(rejected, Rejected)
    assert type(rejected.error.exception()) is RequestError and str(rejected.error.exception()) == "too long"
    assert str(WireError.of(KeyError("x")).exception()) == "KeyError: 'x'"


def test_the_first_message_is_ready_with_the_protocol_or_why_the_engine_did_not_start():
    adapter = LoadedAdapter("sql", 1, 0, "/a", 8, created=1)
    first = ready(pack(Ready(PROTOCOL, INFO, {"running": 0}, [adapter])))
    assert first == Ready(PROTOCOL, INFO, {"running": 0}, [adapter])
    assert ready(pack(Failed("bad block size", config=True))) == Failed("bad block size", config=True)


def test_a_core_of_another_protocol_is_refused_before_its_message_is_read():
    # the rest of a future Ready may have any shape: only the version is read
    with pytest.raises(ProtocolMismatch, match=f"protocol {PROTOCOL + 1}, this front end {PROTOCOL}"):
        ready(msgspec.msgpack.encode(["ready", PROTOCOL + 1, {"some": "new layout"}]))
    with pytest.raises(ProtocolMismatch, match="Outputs, not Ready"):
        ready(pack(Outputs([], {}, None)))


def test_a_message_of_another_shape_is_refused_naming_the_field():
    with pytest.raises(msgspec.ValidationError):   # Abort's request id must be a string
        to_core(msgspec.msgpack.encode(["abort", 7]))
    with pytest.raises(msgspec.ValidationError, match="prompt_ids"):
        to_core(msgspec.msgpack.encode(["add", {"request_id": "r", "prompt_ids": "123"}]))
    with pytest.raises(msgspec.ValidationError):
        to_front_end(msgspec.msgpack.encode(["no-such-message"]))
    with pytest.raises(msgspec.ValidationError):   # a finish reason the enum does not have
        unpack(msgspec.msgpack.encode(["r", [], [], True, "exploded", None, 1, 0, None, None, None]), OutputDelta)


def test_an_invalid_generation_config_is_refused_as_the_core_reads_it():
    """GenerationConfig's own checks run on the core's side too: a request the front end did not check (another
    client of the core) cannot carry a value the engine would misread."""
    bad = msgspec.msgpack.encode(["add", {"request_id": "r", "prompt_ids": [1], "gen_config": {"top_p": 2.0}}])
    with pytest.raises(msgspec.ValidationError, match="top_p"):
        to_core(bad)
