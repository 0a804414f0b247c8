"""The Python API, named after LMDeploy's: ``lmport.pipeline(model)(prompts)``."""
from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import cast

from lmport.worker import scoring
from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.llm import LLM
from lmport.engine.outputs import RequestError


@dataclass
class Response:
    text: str
    token_ids: list[int]
    finish_reason: str | None      # "stop", "length", "abort" or "error"
    input_token_len: int
    generate_token_len: int
    logprobs: list[dict[int, float]] = field(default_factory=list)
    error: str | None = None


class Pipeline:
    def __init__(self, model: str = "smollm2", backend_config: EngineConfig | None = None, backend=None):
        self.engine = LLM(model, backend_config, backend=backend)
        self.tokenizer = self.engine.tokenizer

    # -- prompts ----------------------------------------------------------
    def encode(self, prompt) -> list[int]:
        """A string or a list of {"role", "content"} messages -> token ids through the chat template."""
        return encode_prompt(self.tokenizer, prompt)

    def __call__(self, prompts, gen_config: GenerationConfig | None = None):
        """One prompt -> one Response; a list of prompts -> a list of Responses."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], dict))
        batch = [prompts] if single else list(prompts)
        ids, errors = [], {}
        for i, p in enumerate(batch):
            try:
                ids.append(self.encode(p))
            except RequestError as exc:
                ids.append([])
                errors[i] = str(exc)
        responses = self._run(ids, gen_config, errors)
        return responses[0] if single else responses

    def generate(self, token_ids: list[list[int]], gen_config: GenerationConfig | None = None) -> list[Response]:
        """Raw token ids in, one Response each (no chat template)."""
        return self._run([list(t) for t in token_ids], gen_config, {})

    def _run(self, ids: list[list[int]], gen_config, errors: dict[int, str]) -> list[Response]:
        gen_config = gen_config or GenerationConfig()
        responses: list[Response | None] = [None] * len(ids)
        request_of = {}
        for i, prompt_ids in enumerate(ids):
            if i in errors:
                responses[i] = Response("", [], "error", 0, 0, error=errors[i])
                continue
            try:
                request_of[self.engine.add_request(prompt_ids, gen_config)] = i
            except RequestError as exc:  # this prompt fails alone; the others run
                responses[i] = Response("", [], "error", len(prompt_ids), 0, error=str(exc))
        while request_of:
            for out in self.engine.step():
                if out.finished and out.request_id in request_of:
                    responses[request_of.pop(out.request_id)] = Response(
                        out.text, out.token_ids, out.finish_reason, out.prompt_tokens, len(out.token_ids),
                        out.logprobs, out.error)
        return cast(list[Response], responses)   # every slot is filled: each prompt ends or fails

    def stream(self, prompt, gen_config: GenerationConfig | None = None) -> Iterator[str]:
        """Yield text deltas as they are generated."""
        request_id = self.engine.add_request(self.encode(prompt), gen_config or GenerationConfig())
        try:
            while True:
                for out in self.engine.step():
                    if out.request_id != request_id:
                        continue
                    if out.delta_text:
                        yield out.delta_text
                    if out.finished:
                        if out.error:
                            raise RuntimeError(out.error)
                        return
        finally:
            self.engine.abort(request_id)

    # -- scoring ------------------------------------------------------------
    def get_ppl(self, token_id_lists: list[list[int]],
                logits_budget_bytes: int = scoring.PPL_LOGITS_BUDGET) -> list[float]:
        """Perplexity of each token-id list: exp(mean negative log-likelihood of tokens 2..n).

        Each input is prefilled through the engine's paged KV cache in chunks of at most
        ``logits_budget_bytes / (vocab_size * 4)`` positions (and max_prefill_token_num, which
        the activation reserve covers), so a chunk's float32 logits never exceed the budget.
        """
        return [math.exp(-sum(lps) / len(lps)) for lps in self.get_logprobs(token_id_lists, logits_budget_bytes)]

    def get_logprobs(self, token_id_lists: list[list[int]],
                     logits_budget_bytes: int = scoring.PPL_LOGITS_BUDGET) -> list[list[float]]:
        """Per-token log-likelihoods of each list: log p(t_i | t_<i) for tokens 2..n (what get_ppl averages)."""
        chunk = scoring.chunk_tokens(self.engine, logits_budget_bytes)
        return [scoring.token_logprobs(self.engine, list(ids), chunk)[0] for ids in token_id_lists]

    def close(self) -> None:
        self.engine.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def encode_prompt(tokenizer, prompt, tools: list[dict] | None = None, add_generation_prompt: bool = True,
                  continue_final_message: bool = False) -> list[int]:
    """A string or a list of {"role", "content"} messages -> token ids through the chat template.

    Shared by Pipeline.encode and the server, so both build the same prompt. ``tools`` (OpenAI's
    function tools) go to a template that uses them (lmport.server.tools decides).
    ``add_generation_prompt`` and ``continue_final_message`` are transformers' ``apply_chat_template``
    switches (the assistant turn's opening; the last message continued, its turn left open).
    """
    if isinstance(prompt, str):
        if tokenizer.chat_template is None:   # a base model: the text is the prompt
            return tokenizer.encode(prompt)
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                               for m in prompt):
        raise RequestError('a prompt is a string or a list of {"role": ..., "content": ...} messages')
    if not prompt:
        raise RequestError("the messages list is empty: give at least one message")
    if tokenizer.chat_template is None:
        from lmport.chat_template import NO_TEMPLATE
        raise RequestError(NO_TEMPLATE.replace("start the server with --chat-template FILE", "set "
                                               "tokenizer.chat_template") + " (or give the prompt as a string)")
    return list(tokenizer.apply_chat_template(prompt, add_generation_prompt=add_generation_prompt,
                                              continue_final_message=continue_final_message, tokenize=True,
                                              return_dict=False, **({"tools": tools} if tools else {})))
