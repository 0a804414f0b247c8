"""`lmport bench`: lmport's own benchmarks, over shared workloads (datasets), one HTTP client (client) and one
description of the machine (machine).

- latency: single-stream prefill and decode of a model;
- throughput: an offline batch of mixed requests;
- serve: a streamed load against any OpenAI-compatible server;
- kernels: the cpu and cuda backends' kernels against what they replace.

Every figure is the median (min-max) over interleaved rounds; ``--out DIR`` keeps the JSON (docs/engine.md,
"Benchmarks")."""
