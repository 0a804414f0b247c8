"""lm-evaluation-harness's `local-completions` model against the server: per-document log-likelihoods equal
the pipeline's (Pipeline.get_logprobs). Needs `pip install lm-eval`; the task and its data are local files."""
from __future__ import annotations

import json

import pytest

from lmport.config import EngineConfig
from lmport.engine.engine import Engine
from lmport.server.app import create_app
from support.model_helpers import default_model_path
from test_get_ppl import smollm2_pipeline
from test_server import ServerThread

lm_eval = pytest.importorskip("lm_eval")   # pip install "lm-eval[api]"

DOCS = [
    {"question": "The capital of France is", "choices": ["Paris", "Berlin", "Madrid"], "answer": 0},
    {"question": "Water freezes at a temperature of", "choices": ["zero degrees Celsius", "fifty degrees"],
     "answer": 0},
    {"question": "The opposite of hot is", "choices": ["cold", "loud", "green"], "answer": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0},
]

TASK = """task: lmport_local_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
metric_list:
  - metric: acc
"""


@pytest.mark.slow
def test_local_completions_loglikelihoods_equal_the_pipeline(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager  # pyright: ignore[reportMissingImports] - optional: the test skips without lm-eval
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=data))
    server = ServerThread(create_app(Engine("smollm2", EngineConfig(cache_max_entry_count=256)), model_name="smollm2"))
    try:
        results = lm_eval.simple_evaluate(
            model="local-completions",
            model_args=f"base_url={server.url}/v1/completions,model=smollm2,tokenizer={default_model_path()},"
                       f"tokenizer_backend=huggingface,tokenized_requests=True,num_concurrent=2,max_retries=1",
            tasks=["lmport_local_loglikelihood"], task_manager=TaskManager(include_path=str(tmp_path)),
            log_samples=True)
    finally:
        server.stop()
    samples = results["samples"]["lmport_local_loglikelihood"]
    assert len(samples) == len(DOCS)
    pipe = smollm2_pipeline()
    tok = pipe.tokenizer
    checked = 0
    for sample in samples:
        for (context, continuation), (loglikelihood, _) in zip(
                [r for r in sample["arguments"]], [r[0] for r in sample["resps"]]):
            ctx = tok.encode(context)
            cont = tok.encode(context + continuation)[len(ctx):]
            want = sum(pipe.get_logprobs([ctx + cont])[0][-len(cont):])
            assert loglikelihood == pytest.approx(want, abs=1e-4), (context, continuation)
            checked += 1
    assert checked == sum(len(d["choices"]) for d in DOCS)
