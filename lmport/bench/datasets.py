"""The fixed workloads the benchmarks share: an offline batch of mixed prompt and output lengths, a long prompt
for single-stream runs, and chat requests for a served load. Fixed seeds: every engine and every round meets the
same requests."""
from __future__ import annotations

import random

# Output lengths of the offline batch, in turn (EOS ignored, so every engine produces exactly these).
OUTPUT_LENGTHS = (16, 32, 64, 128)
TEXT = (
    "The history of computing is a story of abstraction layered on abstraction. Early machines were "
    "programmed by rewiring panels; later, stored programs let the same hardware run many tasks. "
    "Operating systems introduced virtual memory, which maps a process's addresses onto physical pages "
    "so that memory can be shared, swapped and protected. Paged attention borrows the same idea: the "
    "key-value cache of each sequence lives in fixed-size blocks that need not be contiguous, so that "
    "many requests of different lengths can share one pool without fragmentation. "
)
# Chat requests of a served load: request i asks for a story about TOPICS[i % len(TOPICS)].
TOPICS = ["the sea", "a lighthouse", "paged attention", "a robot", "autumn", "a library", "mountains", "a city"]
# A JSON schema whose story is longer than any benchmark's max_tokens: a constrained request still generates
# exactly max_tokens tokens.
STORY_SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                               "story": {"type": "string", "minLength": 2000}},
                "required": ["title", "story"]}


def workload(tokenizer, n: int, seed: int, min_prompt: int = 8, max_prompt: int = 256,
             output_lengths: tuple[int, ...] = OUTPUT_LENGTHS) -> list[tuple[list[int], int]]:
    """``n`` (prompt ids, output tokens) pairs: prompts of ``min_prompt``-``max_prompt`` tokens cut from TEXT at
    seeded places, output lengths from ``output_lengths`` in turn."""
    if not 1 <= min_prompt <= max_prompt:
        raise ValueError(f"prompt lengths {min_prompt}-{max_prompt}: give 1 <= min <= max")
    rng = random.Random(seed)
    base = tokenizer.encode(TEXT * 20)
    while len(base) <= max_prompt:
        base = base + base
    requests = []
    for i in range(n):
        length = rng.randint(min_prompt, max_prompt)
        start = rng.randrange(0, len(base) - length)
        requests.append((base[start:start + length], output_lengths[i % len(output_lengths)]))
    return requests


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """The first ``tokens`` ids of TEXT repeated: a single-stream run's prompt."""
    ids = tokenizer.encode(TEXT)
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def chat_messages(i: int) -> list[dict]:
    """Request ``i`` of a served load: a short system message (the default model's template would otherwise add
    its own, longer one) and a request for a story."""
    return [{"role": "system", "content": "You tell stories."},
            {"role": "user", "content": f"Request {i}: a story about {TOPICS[i % len(TOPICS)]}."}]
