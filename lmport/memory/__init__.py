"""Memory: the KV-cache budget, `lmport plan`'s report, and the advice when a model does not fit."""
