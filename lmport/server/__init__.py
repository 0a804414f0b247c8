"""OpenAI-compatible API server."""
