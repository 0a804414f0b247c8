"""Scheduling: which sequences run each step, and the sequences themselves."""
