"""Structured outputs: grammars compiled from response formats, and the token masks they give."""
