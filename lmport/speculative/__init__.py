"""Speculative decoding (docs/speculative.md): proposals (n-gram lookup or a draft model), verified by the
target in one batched forward, accepted so that the output is distributed as without speculation."""
