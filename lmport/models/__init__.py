"""Paged-attention model code and weight loading."""
