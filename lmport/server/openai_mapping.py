"""OpenAI's API in the engine's terms and back: a request's GenerationConfigs, and outputs as OpenAI's chunks and
bodies (logprobs, usage, finish reasons, a failed generation's error).

Kept apart from the transport (``lmport.server.streaming``) so each shape is written once, whichever way the
reply goes; Anthropic's and the Responses API's requests are mapped here too (as chat requests).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

from lmport.config import ConfigError, GenerationConfig
from lmport.engine.outputs import FinishReason, RequestError, RequestOutput
from lmport.reasoning import Reasoning
from lmport.server import echo, tools
from lmport.server.answers import Each
from lmport.server.frontend import Frontend, Job
from lmport.server.protocol import APIError, ChatCompletionRequest, CompletionRequest
from lmport.server.shapes import (AssistantMessage, ChatChoice, ChatCompletion, ChatCompletionChunk,
                                  ChatDelta, ChatFinish, ChatHeader, ChatLogprobs, Completion, CompletionChoice,
                                  CompletionChunk, CompletionHeader, CompletionLogprobs, Finish, TokenLogprob,
                                  ToolCallDelta, TopLogprob, Usage)

# (choice index, output so far, its new text, the first logprob not sent yet) -> the chunks to send
Chunks = Callable[[int, RequestOutput, str, int], Sequence[ChatCompletionChunk | CompletionChunk]]
# every choice's final output (None: a choice with no output) -> the stream's last chunk, with usage
UsageChunk = Callable[[list[RequestOutput | None]], ChatCompletionChunk | CompletionChunk]


# -- requests -------------------------------------------------------------------------------------------------

def job_for(frontend: Frontend, req: ChatCompletionRequest | CompletionRequest, prompts: list[list[int]], param: str,
            max_tokens: int | None, logprobs: int | None, received: float, response_format: dict | None = None,
            key: str | None = None, prompt_logprobs: int | None = None) -> Job:
    """Check every prompt against the engine's facts and map the request to one GenerationConfig per choice.
    ``prompt_logprobs``: each choice also scores its prompt with that many alternatives (echo)."""
    info = frontend.info
    logit_bias = req.token_bias(info.vocab_size)
    # A chat reply whose reasoning markers are special tokens (gpt-oss's harmony) is decoded with them kept.
    parser = frontend.reasoning_parser
    skip_special = not (isinstance(req, ChatCompletionRequest) and parser is not None and parser.keeps_special_tokens)
    configs = []
    for ids in prompts:
        try:
            frontend.check_prompt(ids)
        except RequestError as exc:
            # OpenAI's clients look for this code to tell "shorten the prompt" from other errors.
            code = "context_length_exceeded" if len(ids) >= info.session_len else None
            raise APIError(400, f"{param}: {exc}", param=param, code=code) from None
        # No max_tokens: up to the session length, as OpenAI does up to the context.
        max_new_tokens = info.session_len - len(ids) if max_tokens is None else max_tokens
        for i in range(req.n):
            try:
                configs.append(GenerationConfig(
                    max_new_tokens=max_new_tokens,
                    temperature=req.temperature, do_sample=req.temperature > 0,
                    top_k=max(req.top_k, 0), top_p=req.top_p, min_p=req.min_p,
                    repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    # n choices from one seed differ from each other yet repeat run to run.
                    random_seed=None if req.seed is None else (req.seed + i) % 2**64,
                    stop_words=req.stop_words, ignore_eos=req.ignore_eos, logprobs=logprobs,
                    response_format=response_format, logit_bias=logit_bias,
                    prompt_logprobs=prompt_logprobs, speculate=req.speculate, skip_special_tokens=skip_special))
            except ConfigError as exc:
                raise APIError(400, str(exc)) from None
    return frontend.job(prompts, configs, req.n, received, model=req.model, cache_salt=req.cache_salt, key=key)


def chat_top_logprobs(req: ChatCompletionRequest) -> int | None:
    """How many alternatives each token's logprobs list, None for no logprobs."""
    return (req.top_logprobs or 0) if req.logprobs else None


def chat_job(frontend: Frontend, req: ChatCompletionRequest, prompt_ids: list[int], response_format: dict | None,
             received: float, key: str | None) -> Job:
    job = job_for(frontend, req, [prompt_ids], "messages", req.max_completion_tokens or req.max_tokens,
                  chat_top_logprobs(req), received, response_format, key=key)
    header: ChatHeader = {"id": f"chatcmpl-{job.id}", "object": "chat.completion.chunk", "created": job.created,
                          "model": req.model, "system_fingerprint": frontend.fingerprint}
    job.header = header
    job.stream_usage(req.stream_options)
    return job


def completion_job(frontend: Frontend, req: CompletionRequest, prompts: list[list[int]],
                   response_format: dict | None, received: float, key: str | None) -> Job:
    # echo with logprobs scores each prompt as the engine prefills it; with max_tokens 0 that is all it does.
    scoring = (req.logprobs or 0) if req.echo and (req.logprobs is not None or req.max_tokens == 0) else None
    job = job_for(frontend, req, prompts, "prompt", req.max_tokens, req.logprobs, received, response_format,
                  key=key, prompt_logprobs=scoring)
    header: CompletionHeader = {"id": f"cmpl-{job.id}", "object": "text_completion", "created": job.created,
                                "model": req.model, "system_fingerprint": frontend.fingerprint}
    job.header = header
    job.stream_usage(req.stream_options)
    return job


# -- replies --------------------------------------------------------------------------------------------------

class ChatReply:
    """A chat job's outputs as OpenAI's chat completion, or as its stream's chunks."""

    def __init__(self, tokenizer, job: Job, req: ChatCompletionRequest, setup: tools.ToolSetup | None,
                 reasoning: Reasoning | None = None):
        """``reasoning``: where the reply thinks; its thinking is given apart from the answer (as
        ``reasoning_content`` and, vLLM's newer name, ``reasoning``), or left out with include_reasoning false."""
        self.tokenizer, self.job, self.setup = tokenizer, job, setup
        self.header = cast(ChatHeader, job.header)   # chat_job's
        self.reasoning, self.show_reasoning = reasoning, req.include_reasoning
        self.top = chat_top_logprobs(req)
        choices = len(job.configs)
        self.parsers = [tools.stream_parser(setup) for _ in range(choices)] if setup and req.stream else None
        self.splitters = [reasoning.splitter() for _ in range(choices)] if reasoning and req.stream else None
        self.called = [False] * choices
        self.started = [False] * choices

    def chunks(self, choice: int, out: RequestOutput, text: str, lp_from: int) -> list[ChatCompletionChunk]:
        """OpenAI's stream: the role alone first, then only non-empty deltas, then an empty delta with the
        finish reason. Logprobs go with the text they are of (text held back keeps them back too)."""
        def one(delta: ChatDelta, finish: ChatFinish | None, logprobs: ChatLogprobs | None) -> ChatCompletionChunk:
            return {**self.header, "choices": [{"index": choice, "delta": delta, "finish_reason": finish,
                                                "logprobs": logprobs}]}
        chunks: list[ChatCompletionChunk] = []
        if not self.started[choice]:
            self.started[choice] = True
            role: ChatDelta = {"role": "assistant", "content": None}
            chunks.append(one(role, None, None))
        calls: list[ToolCallDelta] = []
        thought = ""
        if self.splitters:
            thought, text = self.splitters[choice].feed(text, out.finished)
        if self.parsers:
            text, calls = self.parsers[choice].feed(text, out.finished)
            self.called[choice] |= bool(calls)
        delta: ChatDelta = {"content": text} if text else {}
        if thought and self.show_reasoning:
            delta["reasoning_content"] = delta["reasoning"] = thought
        if calls:
            delta["tool_calls"] = calls
        top = self.top
        logprobs = chat_logprobs(self.tokenizer, out, lp_from, top) if top is not None and (delta or out.finished) \
            else None
        if delta:
            chunks.append(one(delta, None, logprobs))
        if out.finished:
            finish = finish_reason(out)
            chunks.append(one({}, "tool_calls" if finish == "stop" and self.called[choice] else finish,
                              None if delta else logprobs))
        return chunks

    def usage_chunk(self, outs: list[RequestOutput | None]) -> ChatCompletionChunk:
        """The stream's last chunk (stream_options.include_usage): no choices, the usage."""
        return {**self.header, "choices": [], "usage": usage(self.job, outs)}

    def body(self, outs: list[RequestOutput]) -> ChatCompletion:
        """The whole answer; its choices, and each choice's logprobs a token at a time, are made as they are
        written (answers.Each)."""
        for o in outs:
            finish_reason(o)   # a failed choice fails the answer before any of it is written
        return {**self.header, "object": "chat.completion", "usage": usage(self.job, outs),
                "choices": Each(len(outs), lambda c: self._choice(c, outs[c]))}

    def _choice(self, c: int, o: RequestOutput) -> ChatChoice:
        message: AssistantMessage = {"role": "assistant", "content": o.text}
        finish: ChatFinish = final_reason(o)
        if self.reasoning is not None:
            thought, answer = self.reasoning.split(o.text)
            message["content"] = answer if answer or thought is None else None
            if self.show_reasoning:
                message["reasoning_content"] = message["reasoning"] = thought
        if self.setup is not None and message["content"] is not None:
            message["content"], calls = tools.parse(message["content"], self.setup)
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        top = self.top
        logprobs: ChatLogprobs | None = None if top is None else {"content": Each(
            min(len(o.token_ids), len(o.logprobs)),
            lambda i: chat_logprob(self.tokenizer, o.token_ids[i], o.logprobs[i], top))}
        return {"index": c, "message": message, "finish_reason": finish, "logprobs": logprobs}


class CompletionReply:
    """A completion job's outputs as OpenAI's text completion, or as its stream's chunks."""

    def __init__(self, tokenizer, job: Job, req: CompletionRequest, given: list[str | list[int]]):
        """``given``: each prompt as the request gave it (text or token ids), for echo."""
        self.tokenizer, self.job, self.top, self.echo, self.given = tokenizer, job, req.logprobs, req.echo, given
        self.header = cast(CompletionHeader, job.header)   # completion_job's

    def _logprobs(self, out: RequestOutput, start: int, lazy: bool = False) -> CompletionLogprobs | None:
        return None if self.top is None else completion_logprobs(self.tokenizer, out, start, self.top, lazy)

    def chunks(self, choice: int, out: RequestOutput, text: str, lp_from: int) -> list[CompletionChunk]:
        if not text and not out.finished:
            return []
        return [{**self.header, "choices": [{"index": choice, "text": text, "finish_reason": finish_reason(out),
                                             "logprobs": self._logprobs(out, lp_from)}]}]

    def usage_chunk(self, outs: list[RequestOutput | None]) -> CompletionChunk:
        """The stream's last chunk (stream_options.include_usage): no choices, the usage."""
        return {**self.header, "choices": [], "usage": usage(self.job, outs)}

    def body(self, outs: list[RequestOutput]) -> Completion:
        """The whole answer; its choices are made one at a time as they are written (answers.Each)."""
        for o in outs:
            finish_reason(o)   # a failed choice fails the answer before any of it is written
        if self.echo:
            return self._echo_body(outs)

        def choice(c: int) -> CompletionChoice:
            return {"index": c, "text": outs[c].text, "finish_reason": final_reason(outs[c]),
                    "logprobs": self._logprobs(outs[c], 0, lazy=True)}
        return {**self.header, "usage": usage(self.job, outs), "choices": Each(len(outs), choice)}

    def _echo_body(self, outs: list[RequestOutput]) -> Completion:
        """The prompt (text and logprobs) before each choice's completion; only the prompt with max_tokens 0."""
        job, top = self.job, self.top
        texts = [p if isinstance(p, str) else self.tokenizer.decode(p) for p in self.given]

        def choice(c: int) -> CompletionChoice:
            o, ids = outs[c], job.prompt_of(c)
            scores = None if top is None else echo.prompt_scores(ids, o.prompt_logprobs or [])
            return {"index": c, "text": texts[c // job.n] + o.text, "finish_reason": final_reason(o),
                    "logprobs": echo.merge(self.tokenizer, ids, scores, top, self._logprobs(o, 0))}
        return {**self.header, "choices": Each(len(outs), choice), "usage": usage(job, outs)}


# -- pieces of replies ----------------------------------------------------------------------------------------

def token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id])


def chat_logprobs(tokenizer, out: RequestOutput, start: int, top: int) -> ChatLogprobs:
    return {"content": [chat_logprob(tokenizer, token_id, entry, top)
                        for token_id, entry in zip(out.token_ids[start:], out.logprobs[start:])]}


def chat_logprob(tokenizer, token_id: int, entry: dict[int, float], top: int) -> TokenLogprob:
    """One token's entry in a chat answer's logprobs: the token and its ``top`` alternatives."""
    best = sorted(entry.items(), key=lambda kv: -kv[1])[:top]
    return {**_logprob(tokenizer, token_id, entry[token_id]),
            "top_logprobs": [_logprob(tokenizer, t, lp) for t, lp in best]}


def completion_logprobs(tokenizer, out: RequestOutput, start: int, top: int,
                        lazy: bool = False) -> CompletionLogprobs:
    """OpenAI's legacy logprobs for tokens ``start:``; text_offset counts the tokens' own texts. ``lazy``: the
    top logprobs (a dict a token) made as they are written (answers.Each), for a whole answer."""
    offset = sum(len(token_text(tokenizer, t)) for t in out.token_ids[:start])
    tokens = [token_text(tokenizer, t) for t in out.token_ids[start:]]
    offsets = []
    for text in tokens:
        offsets.append(offset)
        offset += len(text)
    entries = out.logprobs[start:]

    def best(entry: dict[int, float]) -> dict[str, float]:
        return {token_text(tokenizer, t): lp for t, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top]}
    return {"tokens": tokens,
            "token_logprobs": [entry[t] for t, entry in zip(out.token_ids[start:], entries)],
            "top_logprobs": Each(len(entries), lambda i: best(entries[i])) if lazy else [best(e) for e in entries],
            "text_offset": offsets}


def _logprob(tokenizer, token_id: int, logprob: float) -> TopLogprob:
    text = token_text(tokenizer, token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def usage(job: Job, outs: list[RequestOutput] | list[RequestOutput | None]) -> Usage:
    """``outs`` by choice (None: a choice with no output)."""
    prompt = sum(len(p) for p in job.prompts)
    completion = sum(len(o.token_ids) for o in outs if o is not None)
    # A prompt counts once however many choices it has, so do its cached tokens: the most any choice found.
    cached = sum(max((o.cached_tokens for o in outs[p * job.n:(p + 1) * job.n] if o is not None), default=0)
                 for p in range(len(job.prompts)))
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def finish_reason(out: RequestOutput) -> Finish | None:
    """An output's finish reason, None until it has finished; a failed one raises its error."""
    return final_reason(out) if out.finished else None


def final_reason(out: RequestOutput) -> Finish:
    """A finished output's finish reason; a failed one raises its error."""
    if out.finish_reason == FinishReason.ERROR:
        raise generation_error(out)
    # The enum's string, as the API has it: stop or length (an aborted output is never answered).
    return str(out.finish_reason)   # pyright: ignore[reportReturnType]


def generation_error(out: RequestOutput, choice: int | None = None) -> APIError:
    """The error that ended a choice: a 400 when its own format caused it (RequestOutput.request_fault),
    else a 500."""
    where = "" if choice is None else f"choice {choice}: "
    if out.request_fault:
        return APIError(400, f"{where}{out.error}", param="response_format", code="format_failed")
    return APIError(500, f"{where}generation failed: {out.error}", type="server_error")
