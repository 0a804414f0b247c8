"""The ways in: the `lmport` command, its flags, interactive chat and the Python pipeline."""
