"""Draft-model proposals: a second, smaller model with the target's tokenizer proposes k tokens a step.

The draft runs whole in the driver's process (rank 0's device, under tensor parallelism too) with its own KV
cache. That cache mirrors the target's: it has as many blocks of the same size, and a sequence's draft K/V
lives in the blocks of the sequence's own (target) block table. The block manager therefore keeps one set of
tables for both models: a rollback, a preemption, a finish or a prefix-cache hit moves the draft's blocks with
the target's, and no draft block can leak. What the draft keeps per sequence is how many of its tokens it has
computed, into which blocks (and the preemption count it computed them under); the next proposal first computes
the rest ("catch-up": a new prompt, the tokens accepted last step, everything after a preemption), then the
proposal itself.

With the prefix cache on, the draft also remembers which prefix each of its full blocks holds (by the prefix
cache's chained hash): a sequence whose prompt hits the cache, or that comes back after a preemption, starts its
catch-up after the leading blocks whose draft K/V are still there, as the target starts after its cached ones.
Only the draft's forwards write its cache, and each forgets what the blocks it writes held, so a remembered hash
always describes the block's contents.

Proposals are made for all speculating sequences together: one batched catch-up forward (chunked at
``max_prefill_token_num`` tokens), then one batched single-token forward for each further proposed token.
Each token is chosen as a plain step of the request would choose it on the draft's logits (logit bias,
penalties, temperature, top-k, top-p, min-p: ``lmport.worker.sampling``), greedy for greedy requests; for sampling
requests the probabilities it was drawn from go to the acceptance rule (``lmport.speculative.acceptance``),
so the output is distributed as the target's own.
"""
from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import cast

import torch

from lmport.platform.backend import Backend
from lmport.config import ConfigError, EngineConfig
from lmport.models.loader import ModelNotFound, load_tokenizer, read_model_config, resolve_model_path
from lmport.models.parameters import count_parameters
from lmport.models.windows import kv_window
from lmport.worker.runner import ModelRunner, StepInput
from lmport.worker.sampling import adjusted_logits, draw_one, greedy_tokens, samples, sampling_probs
from lmport.sched.sequence import Sequence
from lmport.weights.checkpoint import check_backend

log = logging.getLogger(__name__)

TOKEN_SAMPLE = 256   # token strings compared between the two tokenizers (and the first and last 32)


def draft_config(config: EngineConfig) -> EngineConfig:
    """The engine config the draft runs under: one device, eager, no LoRA slots, no speculation of its own."""
    return dataclasses.replace(config, tp=1, eager_mode=True, max_loras=0, speculative=None)


def check_draft(model: str, config: EngineConfig) -> None:
    """ConfigError naming the problem when ``config.speculative.model`` cannot draft for ``model``; reads
    configs, headers and tokenizers only, before any weight loads."""
    spec = config.speculative
    if spec is None or spec.model is None:
        raise ConfigError("check_draft needs config.speculative with method='draft' and a model")
    draft = spec.model
    try:
        path = resolve_model_path(draft)
    except ModelNotFound as exc:
        raise ConfigError(f"speculative.model: {exc}") from None
    check_backend(path, config.backend_class().capabilities, config.weight_format)
    target_cfg, draft_cfg = read_model_config(model), read_model_config(draft)
    if kv_window(target_cfg) is not None:
        raise ConfigError(f"speculative.method='draft' with {model!r}, whose every layer slides over "
                          f"{kv_window(target_cfg)} tokens, is not supported: the blocks behind the window are "
                          f"freed, and the draft's cache lives in them; use method='ngram'")
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"speculative.model {draft!r} has a vocabulary of {draft_cfg.vocab_size} tokens, the "
                          f"target {model!r} {target_cfg.vocab_size}: a draft must share the target's tokenizer "
                          f"(use a smaller model of the same family)")
    target_params, draft_params = count_parameters(target_cfg), count_parameters(draft_cfg)
    if draft_params > target_params:
        raise ConfigError(f"speculative.model {draft!r} ({draft_params / 1e6:.1f}M parameters) is larger than "
                          f"the target {model!r} ({target_params / 1e6:.1f}M): a draft must be the smaller model; "
                          f"swap them or pick a smaller draft")
    check_same_tokens(load_tokenizer(model), load_tokenizer(draft), model, draft)


def check_same_tokens(target_tok, draft_tok, model: str, draft: str) -> None:
    """ConfigError unless the two tokenizers have as many tokens and the same strings at a sample of ids."""
    if len(target_tok) != len(draft_tok):
        raise ConfigError(f"speculative.model {draft!r}'s tokenizer has {len(draft_tok)} tokens, the target "
                          f"{model!r}'s {len(target_tok)}: a draft must share the target's tokenizer")
    n = len(target_tok)
    ids = sorted({*range(min(32, n)), *range(max(0, n - 32), n), *random.Random(0).sample(range(n),
                                                                                          min(TOKEN_SAMPLE, n))})
    a, b = target_tok.convert_ids_to_tokens(ids), draft_tok.convert_ids_to_tokens(ids)
    differ = [(i, x, y) for i, x, y in zip(ids, a, b) if x != y]
    if differ:
        i, x, y = differ[0]
        raise ConfigError(f"speculative.model {draft!r}'s tokenizer differs from the target {model!r}'s at "
                          f"{len(differ)} of {len(ids)} sampled token ids (id {i}: {y!r} against {x!r}): a draft "
                          f"must share the target's tokenizer")


@dataclass
class _Progress:
    computed: int      # the sequence's first tokens whose draft K/V are in the draft's cache
    preemptions: int   # the sequence's preemption count then (a preemption leaves other blocks)
    blocks: list[int] = field(default_factory=list)   # the blocks they are in (the prefix cache may swap one)
    named: int = 0     # leading full blocks whose prefix hash ``DraftModel.holds`` records


def _no_hashes(seq: Sequence, num_blocks: int) -> list[bytes]:   # until allocate() names the blocks
    return []


class DraftModel:
    """The draft's runner, its cache (mirroring the target's blocks) and how far it has computed each sequence."""

    def __init__(self, model: str, config: EngineConfig, backend: Backend):
        self.config = draft_config(config)
        self.runner = ModelRunner(model, self.config, backend)
        self.layout = self.runner.layout
        self.caches: list = []
        self._progress: dict[Sequence, _Progress] = {}
        self.holds: dict[int, bytes] = {}   # draft block -> the prefix hash whose draft K/V it holds
        self._prefix_hashes: Callable[[Sequence, int], list[bytes]] = _no_hashes

    def allocate(self, num_blocks: int, prefix_hashes: Callable[[Sequence, int], list[bytes]]) -> None:
        """The draft's cache: ``num_blocks`` blocks, as many as the target's. ``prefix_hashes(seq, n)``: the
        hashes the prefix cache names a sequence's first n full blocks by (``BlockManager.prefix_hashes``;
        none without a prefix cache, and then no block is reused across sequences)."""
        self.caches = self.layout.allocate(num_blocks, self.runner.backend.device)
        self._prefix_hashes = prefix_hashes
        self.holds.clear()

    @property
    def cache_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for c in self.caches
                   for t in (c.k, c.v, c.k_qparams, c.v_qparams) if t is not None)

    def close(self) -> None:
        self.runner.close()
        self.caches = []
        self._progress.clear()
        self.holds.clear()

    def forget(self, seq: Sequence) -> None:
        self._progress.pop(seq, None)

    def propose(self, seqs: list[Sequence], counts: list[int]) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """``counts[i]`` draft tokens for each decoding sequence (whose blocks hold room for them), and for a
        sampling sequence the [count, vocab] probabilities each was drawn from (None for a greedy one)."""
        logits = self._catch_up(seqs)
        proposals: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            for i, (token, q) in zip(active, self._choose(logits, [seqs[i] for i in active],
                                                          [proposals[i] for i in active])):
                proposals[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(proposals[i]) < counts[i]]
            if not active:
                break
            # The last proposed token goes in at its position; its logits give the next one.
            step = StepInput([proposals[i][-1] for i in active], [1] * len(active),
                             [seqs[i].num_tokens + len(proposals[i]) for i in active],
                             [seqs[i].block_table for i in active], list(range(len(active))))
            logits = self._forward(step)
        for seq, count in zip(seqs, counts):   # the last proposed token is not computed (the target verifies it)
            progress = self._progress[seq]
            progress.computed = seq.num_tokens + count - 1
            progress.blocks = list(seq.block_table)
        return proposals, [torch.stack(p) if p else None for p in probs]

    def _start(self, seq: Sequence) -> int:
        """The sequence's first position whose draft K/V is not (or no longer) in the blocks its table names:
        past neither the target's computed tokens (rejected proposals are rolled back) nor a preemption, nor a
        block the prefix cache swapped for its own copy; but past the leading blocks the draft holds by hash."""
        bs, computed = self.layout.block_size, 0
        progress = self._progress.get(seq)
        if progress is not None and progress.preemptions == seq.num_preemptions:
            computed = min(progress.computed, seq.num_computed)
            for i, block in enumerate(progress.blocks[:-(-computed // bs)]):
                if seq.block_table[i] != block:
                    computed = i * bs
                    break
        if computed // bs < seq.num_computed // bs:   # whole blocks to compute: the draft may hold them already
            held = 0
            hashes = self._prefix_hashes(seq, seq.num_computed // bs)
            while held < len(hashes) and self.holds.get(seq.block_table[held]) == hashes[held]:
                held += 1
            computed = max(computed, held * bs)
        return min(computed, seq.num_computed)

    def _name_blocks(self, seq: Sequence) -> None:
        """Records the prefix hash of each full block of real tokens the draft has computed for ``seq``."""
        progress = self._progress[seq]
        full = seq.num_tokens // self.layout.block_size
        if progress.named < full:
            for i, h in enumerate(self._prefix_hashes(seq, full)[progress.named:], progress.named):
                self.holds[seq.block_table[i]] = h
            progress.named = full

    def _catch_up(self, seqs: list[Sequence]) -> torch.Tensor:
        """Computes each sequence's tokens the draft has not, its last one included, in forwards of at most
        ``max_prefill_token_num`` tokens; the draft's logits after each sequence's last token [seqs, vocab]."""
        positions = [self._start(s) for s in seqs]
        for s, p in zip(seqs, positions):
            progress = self._progress.get(s)
            if progress is None or progress.preemptions != s.num_preemptions or p < progress.computed:
                self._progress[s] = _Progress(p, s.num_preemptions, named=p // self.layout.block_size)
        last: list[torch.Tensor | None] = [None] * len(seqs)
        while any(p < s.num_tokens for p, s in zip(positions, seqs)):
            budget, chunk = self.config.max_prefill_token_num, []
            for i, (p, s) in enumerate(zip(positions, seqs)):
                if p < s.num_tokens and budget > 0:
                    chunk.append((i, min(s.num_tokens - p, budget)))
                    budget -= chunk[-1][1]
            ends = [positions[i] + n for i, n in chunk]
            done = [j for j, ((i, _), end) in enumerate(zip(chunk, ends)) if end == seqs[i].num_tokens]
            rows = [sum(n for _, n in chunk[:j + 1]) - 1 for j in done]
            step = StepInput([t for (i, n) in chunk for t in seqs[i].token_ids[positions[i]:positions[i] + n]],
                             [n for _, n in chunk], ends, [seqs[i].block_table for i, _ in chunk], rows)
            logits = self._forward(step)
            for row, j in enumerate(done):
                last[chunk[j][0]] = logits[row]
            for (i, _), end in zip(chunk, ends):
                positions[i] = end
        for s in seqs:
            self._name_blocks(s)
        return torch.stack([x for x in last if x is not None])

    def _forward(self, step: StepInput) -> torch.Tensor:
        bs = self.layout.block_size
        for n, end, table in zip(step.q_lens, step.kv_lens, step.block_tables):
            for block in table[(end - n) // bs:-(-end // bs)]:   # what they held is overwritten
                self.holds.pop(block, None)
        return cast(torch.Tensor, self.runner.forward(step, self.caches))   # tp=1: the runner returns the logits

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], proposed: list[list[int]]
                ) -> list[tuple[int, torch.Tensor | None]]:
        """One draft token a sequence, chosen as a plain step of its request would choose it after the tokens
        already proposed; for a sampling sequence with the probabilities it was drawn from."""
        views = [dataclasses.replace(s, output_ids=s.output_ids + p) if p else s for s, p in zip(seqs, proposed)]
        adjusted = adjusted_logits(logits.float(), views)
        tokens: list[tuple[int, torch.Tensor | None]] = [(t, None) for t in greedy_tokens(adjusted)]
        drawn = [i for i, v in enumerate(views) if samples(v)]
        if drawn:
            rows = sampling_probs(adjusted[drawn], [views[i] for i in drawn])
            for i, q in zip(drawn, rows):
                if q.sum() <= 0:   # nothing finite to draw from: the greedy token, as a point mass
                    q = torch.zeros_like(q)
                    q[tokens[i][0]] = 1.0
                token = draw_one(q, seqs[i].generator)
                tokens[i] = (token, q)
        return tokens
