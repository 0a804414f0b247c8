"""The one processor that gives a request's outputs (``lmport.engine.outputs.RequestOutput``) their text.

The engine core (scheduler, sampling, the grammar, stop token ids, max_new_tokens and session_len) emits each
request's new token ids and their logprobs. ``OutputProcessor`` keeps each request's output state (its
incremental decoder, the text shown so far, its stop strings) and turns those outputs into ``RequestOutput``s
with ``text`` and ``delta_text`` (``lmport.engine.detokenize``): a trailing partial character and text that may yet
start a stop string are held back; a request that ends has its whole output decoded once, a partial last
character too. A stop string ends the request here, at once: its text is cut before the stop string and its
tokens end with the one that completed it; ``process`` reports it, and the caller ends it in the core, which
does not know the stop strings (``EngineCore.finish_request``). A request whose text cannot be decoded ends with
an error the same way.

The grammar of a structured output is not output state: it stays in the core, beside sampling, because its
token mask is needed before each token is drawn (and a speculative proposal's rows are masked with it).

Under ``lmport serve`` it runs on the front end's side (``lmport.engine.client``), off the core's critical path;
the in-process LLM (``lmport.engine.llm``) runs the same processor after each of its core's steps.
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

from lmport.engine import detokenize
from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, FinishReason, RequestOutput

log = logging.getLogger(__name__)


@dataclass
class RequestState:
    """One request's output state."""
    decoder: detokenize.IncrementalDecoder
    stop_words: list[str] | None
    skip_special_tokens: bool
    token_ids: list[int] = field(default_factory=list)              # every token received, up to a stop string
    logprobs: list[dict[int, float]] = field(default_factory=list)  # kept only for outputs of everything so far
    text: str = ""   # the text shown so far; once finished, the whole text
    prompt_logprobs: list[dict[int, float]] | None = None   # gen_config.prompt_logprobs: the core sends them once


class OutputProcessor:
    def __init__(self, tokenizer, cumulative: bool):
        """``cumulative``: each output carries every token id and logprob so far (the in-process API), else
        only the new ones (a server's stream, which adds them up itself)."""
        self.tokenizer = tokenizer
        self.cumulative = cumulative
        self.requests: dict[str, RequestState] = {}

    def add(self, request_id: str, gen_config: GenerationConfig) -> None:
        self.requests[request_id] = RequestState(
            detokenize.IncrementalDecoder(self.tokenizer, gen_config.skip_special_tokens), gen_config.stop_words,
            gen_config.skip_special_tokens)

    def forget(self, request_id: str) -> None:
        """Drop a request that will have no more outputs (the core refused it, or stopped)."""
        self.requests.pop(request_id, None)

    def process(self, outputs: Iterable[RequestOutput]) -> tuple[list[RequestOutput], list[RequestOutput]]:
        """(the caller's outputs, those of them that ended here while the core still runs them: the caller
        aborts each in the core). An output of a request not added here, or ended here already, is dropped: the
        core's last output of a request a stop string ended (its abort) is one."""
        processed, ended = [], []
        for core_out in outputs:
            state = self.requests.get(core_out.request_id)
            if state is None:
                continue
            try:
                out = self._update(state, core_out)
            except Exception as exc:   # a tokenizer that fails on these ids: this request fails, no other
                log.error("request %s failed in decoding: %s: %s", core_out.request_id, type(exc).__name__, exc)
                error = f"decoding failed: {type(exc).__name__}: {exc}"
                out = self._output(state, core_out, [], [], "", FinishReason.ERROR, error, ErrorKind.ENGINE)
            if out.finished:
                del self.requests[out.request_id]
                if not core_out.finished:
                    ended.append(out)
            processed.append(out)
        return processed, ended

    def _update(self, state: RequestState, core_out: RequestOutput) -> RequestOutput:
        """The core's new tokens appended one by one, as they were drawn, until a stop string ends the request."""
        tokens, logprobs = core_out.delta_token_ids, core_out.delta_logprobs
        if core_out.prompt_logprobs is not None:
            state.prompt_logprobs = core_out.prompt_logprobs
        reason = core_out.finish_reason if core_out.finished else None
        delta = ""
        for i, token in enumerate(tokens):
            old_text = state.text
            state.token_ids.append(token)
            if logprobs and self.cumulative:
                state.logprobs.append(logprobs[i])
            text = state.decoder.update(state.token_ids)
            last = i == len(tokens) - 1
            # A stop token ended it in the core: the stop strings are not looked for in its text (as before
            # they were moved here, a stop token is checked first and a stop string before max_new_tokens).
            stop_token = last and reason == FinishReason.STOP
            cut = None
            if state.stop_words and not stop_token:
                cut = detokenize.first_stop(text, state.stop_words, len(old_text))
            if cut is not None:
                state.text = text[:cut]
                delta += detokenize.final_delta(state.text, old_text)
                return self._output(state, core_out, tokens[:i + 1], logprobs[:i + 1], delta, FinishReason.STOP)
            if last and reason is not None:   # decoded whole, once: its exact text, a partial last character too
                state.text = detokenize.decode(self.tokenizer, state.token_ids,
                                               skip_special_tokens=state.skip_special_tokens)
                delta += detokenize.final_delta(state.text, old_text)
            else:
                step_delta = detokenize.streamable_delta(text, old_text, state.stop_words)
                state.text = old_text + step_delta
                delta += step_delta
        return self._output(state, core_out, tokens, logprobs, delta, reason, core_out.error, core_out.error_kind)

    def _output(self, state: RequestState, core_out: RequestOutput, tokens: list[int], logprobs: list,
                delta: str, reason: FinishReason | None, error: str | None = None,
                error_kind: ErrorKind | None = None) -> RequestOutput:
        finished = reason is not None
        return RequestOutput(
            request_id=core_out.request_id, token_ids=list(state.token_ids) if self.cumulative else [],
            text=state.text, delta_token_ids=tokens, delta_text=delta, finished=finished, finish_reason=reason,
            prompt_tokens=core_out.prompt_tokens, cached_tokens=core_out.cached_tokens,
            logprobs=list(state.logprobs) if self.cumulative else [], error=error, delta_logprobs=logprobs,
            prompt_logprobs=state.prompt_logprobs if finished else None, embedding=core_out.embedding,
            error_kind=error_kind)
