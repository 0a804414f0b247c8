"""Quantized weights: the internal format (format.py), and loaders that map checkpoints onto it."""
