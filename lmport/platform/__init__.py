"""The backend contract, backend discovery and the config resolved against a backend."""
