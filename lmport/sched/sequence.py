"""A request's token ids, state and outcome as the scheduler and engine core see it.

Its text (decoder, stop strings, text so far) is not here: that is the caller's output state
(lmport.engine.output_processor). The grammar matcher is, since sampling needs its mask before each token."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from lmport.config import GenerationConfig
from lmport.engine.outputs import ErrorKind, Failure, FinishReason
from lmport.multimodal.inputs import ImageInput


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    gen_config: GenerationConfig
    stop_token_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0           # tokens whose K/V are in the cache
    num_cached_prefix: int = 0      # prompt tokens served from the prefix cache at admission
    cache_salt: str | None = None   # prefix-cache isolation: only requests with the same salt share blocks
    prefix_hits: dict[str, int] = field(default_factory=dict)  # prefix-cache blocks: "device"/"host" hits, "miss"
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: str | None = None          # finish_reason ERROR: why
    error_kind: ErrorKind | None = None   # ... and whose fault it is
    generator: torch.Generator | None = None
    grammar: object | None = None   # xgrammar matcher of a structured output, advanced per token
    # gen_config.prompt_logprobs: position i's entry is log p(prompt[i + 1] | prompt[:i + 1]) with the top
    # alternatives, {token id: logprob}; filled chunk by chunk as the prompt is prefilled.
    prompt_logprobs: list[dict[int, float]] = field(default_factory=list)
    max_scoring_tokens: int = 0     # positions a step may score (their float32 logits stay within a budget)
    adapter_id: int = 0             # the LoRA adapter it runs with (lmport.lora.table), 0: the base model
    pooling: str | None = None      # an embedding request: "mean" or "last"; it generates nothing
    pooled: torch.Tensor | None = None   # a "mean" embedding request's pooled sum over the chunks computed so far
    state_slot: int = -1            # its recurrent-state slot while running (lmport.kv.state_pool), -1: none
    images: list[ImageInput] = field(default_factory=list)   # the prompt's images (lmport.multimodal), in order
    images_key: str | None = None   # what its images add to its prefix-cache key (lmport.multimodal.inputs.images_key)
    group: str | None = None        # the client request it is one choice of (n > 1): they yield blocks first

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end], without copying the rest of the sequence (a decode step's one new token)."""
        prompt = len(self.prompt_ids)
        if start >= prompt:
            return self.output_ids[start - prompt:end - prompt]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - prompt)]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def scoring(self) -> bool:
        """Prompt positions remain whose log-probabilities were asked for and not computed yet."""
        return (self.gen_config.prompt_logprobs is not None
                and len(self.prompt_logprobs) < len(self.prompt_ids) - 1)

    def step_limit(self, tokens: int) -> int:
        """``tokens`` bounded by what a step may compute for this sequence (a scoring chunk's logits budget)."""
        return min(tokens, self.max_scoring_tokens) if self.scoring and self.max_scoring_tokens else tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def finish(self, reason: FinishReason, failure: Failure | None = None) -> None:
        self.status = Status.FINISHED
        self.finish_reason = reason
        if failure is not None:
            self.error, self.error_kind = failure.message, failure.kind
