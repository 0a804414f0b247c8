"""The engine: the core (token ids in, token ids out), its process and client, the messages between them,
and the outputs users read."""
