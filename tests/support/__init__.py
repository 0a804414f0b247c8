"""Helpers for the tests: GGML block quantizers, GGUF files written as llama.cpp's converter writes them,
and tiny random-weight models of each architecture lmport runs."""
