"""Embeddings from the engine's prefill path against sentence-transformers on the same model.

sentence-transformers models (mean pooling + Normalize, last-token pooling without it) are built over
the tiny Llama model and saved (tests/support/st_models.py); the engine reads their pooling from the
saved configuration and runs the texts through its steps, batched with a generation request, with
prompts longer than a prefill chunk. Vectors equal sentence-transformers' ``encode`` within 1e-4
(and cosine > 0.9999); all at once equals one by one. The default model is compared in the slow set.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lmport import EngineConfig, GenerationConfig
from lmport.config import ConfigError
from lmport.engine.engine import Engine, RequestError
from lmport.engine.pooling import PoolingConfig, finish, pooling_config
from support.st_models import st_model, tiny_st_dir

TEXTS = ["Hello world", "Paged attention keeps the KV cache in fixed-size blocks, so sequences grow without "
         "copying " * 6, "a", "The quick brown fox jumps over the lazy dog."]


def embed(engine: Engine, texts: list[str], mode: str, with_generation: bool = True) -> list[list[float]]:
    """All texts at once (beside a generation request when asked); the pooled vectors in order."""
    ids = [engine.add_request(engine.tokenizer.encode(t), request_id=f"e{i}", pooling=mode)
           for i, t in enumerate(texts)]
    if with_generation:
        engine.add_request(list(range(5, 40)), GenerationConfig(max_new_tokens=6, ignore_eos=True), "gen")
    got: dict[str, list[float]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.embedding is not None:
                got[out.request_id] = out.embedding
            elif out.finished:
                assert out.request_id == "gen" and len(out.token_ids) == 6
    assert engine.usage()["blocks_used"] == 0   # no KV kept
    return [got[i] for i in ids]


def check_close(got: list[list[float]], want) -> None:
    got_t = torch.tensor(got)
    want_t = torch.stack([torch.as_tensor(w, dtype=torch.float32) for w in want])
    torch.testing.assert_close(got_t, want_t, atol=1e-4, rtol=1e-4)
    assert torch.nn.functional.cosine_similarity(got_t, want_t).min() > 0.9999


@pytest.mark.parametrize("pooling,normalize", [("mean", True), ("lasttoken", False)])
def test_tiny_model_matches_sentence_transformers(pooling, normalize):
    path = tiny_st_dir(pooling, normalize)
    config = pooling_config(Path(path))
    assert config.mode == ("mean" if pooling == "mean" else "last") and config.normalize == normalize
    want = [st_model(path).encode(t, convert_to_numpy=True) for t in TEXTS]   # one at a time: no padding
    # max_prefill_token_num 16: the long text is prefilled in several chunks (mean pooling sums across them)
    engine = Engine(path, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64,
                                       max_prefill_token_num=16, enable_prefix_caching=True, block_size=4))
    try:
        together = [finish(v, config) for v in embed(engine, TEXTS, config.mode)]
        alone = [finish(embed(engine, [t], config.mode, with_generation=False)[0], config) for t in TEXTS]
        again = [finish(v, config) for v in embed(engine, TEXTS, config.mode)]   # prefix cache warm
    finally:
        engine.close()
    check_close(together, want)
    torch.testing.assert_close(torch.tensor(together), torch.tensor(alone), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(together), torch.tensor(again), atol=1e-5, rtol=1e-5)


def test_pooling_config_default_and_refusals(tmp_path):
    assert pooling_config(tmp_path) == PoolingConfig("last", True, PoolingConfig().source)
    (tmp_path / "modules.json").write_text('[{"idx": 0, "name": "0", "path": "", "type": "x.Transformer"},'
                                           '{"idx": 1, "name": "1", "path": "1_Pooling", "type": "x.Pooling"}]')
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_cls_token": true}')
    with pytest.raises(ConfigError, match="pooling_mode_cls_token"):
        pooling_config(tmp_path)
    assert finish([3.0, 4.0], PoolingConfig()) == [0.6, 0.8]


def test_bad_pooling_is_refused():
    engine = Engine(tiny_st_dir("mean", True), EngineConfig(device_type="cpu", dtype="float32",
                                                             cache_max_entry_count=16))
    try:
        with pytest.raises(RequestError, match="pooling must be one of"):
            engine.add_request([5, 6], pooling="max")
    finally:
        engine.close()


@pytest.mark.slow
def test_default_model_matches_sentence_transformers():
    from support.model_helpers import default_model_path
    from support.st_models import st_model_dir
    path = st_model_dir(str(default_model_path()), "mean", True)
    want = [st_model(path).encode(t, convert_to_numpy=True) for t in TEXTS]
    engine = Engine(path, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=128,
                                       max_prefill_token_num=32))
    try:
        got = [finish(v, pooling_config(Path(path))) for v in embed(engine, TEXTS, "mean")]
    finally:
        engine.close()
    check_close(got, want)


def test_server_embeddings_with_the_openai_client():
    import httpx
    import openai
    import pydantic
    from test_server import ServerThread

    from lmport.server import shapes
    from lmport.server.app import create_app
    path = tiny_st_dir("mean", True)
    want = [st_model(path).encode(t, convert_to_numpy=True) for t in TEXTS]
    engine = Engine(path, EngineConfig(device_type="cpu", dtype="float32", cache_max_entry_count=64))
    srv = ServerThread(create_app(engine, model_name="tiny-st"))
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        floats = client.embeddings.create(model="tiny-st", input=TEXTS, encoding_format="float")
        packed = client.embeddings.create(model="tiny-st", input=TEXTS)   # the client asks for base64, decodes it
        ids = client.embeddings.create(model="tiny-st", input=[engine.tokenizer.encode(t) for t in TEXTS])
        check_close([d.embedding for d in floats.data], want)
        check_close([d.embedding for d in packed.data], want)
        check_close([d.embedding for d in ids.data], want)
        assert floats.model == "tiny-st" and [d.index for d in floats.data] == [0, 1, 2, 3]
        for encoding in ("float", "base64"):   # the answer as sent is the document's EmbeddingList, no field more
            raw = httpx.post(srv.url + "/v1/embeddings", json={"model": "tiny-st", "input": TEXTS[:2],
                                                               "encoding_format": encoding}, timeout=60)
            pydantic.TypeAdapter(shapes.EmbeddingList).validate_python(raw.json())
        assert floats.usage.prompt_tokens == sum(len(engine.tokenizer.encode(t)) for t in TEXTS)
        for bad, param in (({"dimensions": 7}, "dimensions"), ({"input": []}, "input"), ({"input": ""}, "input"),
                           ({"extra_body": {"truncate_prompt_tokens": 2}}, "truncate_prompt_tokens"),
                           ({"extra_body": {"normalize": False}}, "normalize")):   # this model normalizes
            with pytest.raises(openai.BadRequestError) as err:
                client.embeddings.create(**{"model": "tiny-st", "input": "hi", **bad})
            assert err.value.body["param"] == param
        # what the model does anyway, and a field that names nothing, are accepted
        same = client.embeddings.create(model="tiny-st", input=TEXTS, encoding_format="float",
                                        extra_body={"normalize": True, "add_special_tokens": True, "x_note": 1})
        assert [d.embedding for d in same.data] == [d.embedding for d in floats.data]
        with pytest.raises(openai.NotFoundError) as err:
            client.embeddings.create(model="other", input="hi")
        assert err.value.body["param"] == "model"
    finally:
        srv.stop()
