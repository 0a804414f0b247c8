"""What the HTTP server reads of its engine, for a front end that has none in its process (``--dp N``).

The server (``lmport.server.serving.Server``) tokenizes, checks prompts and compiles grammars itself, before a
request reaches an engine. With data-parallel replicas it does that against this view: the model's tokenizer
and config loaded here (no weights), and the limits the replicas reported (all replicas of one model and
config agree on them). ``config.max_batch_size`` is the replicas' sum, so the server admits as many requests
as all of them run at once.
"""
from __future__ import annotations

import dataclasses

from lmport.config import EngineConfig
from lmport.dp.frontend import DataParallel
from lmport.engine import RequestError, check_prompt
from lmport.guided import Grammars
from lmport.models.loader import load_tokenizer, read_model_config


class ServedModel:
    def __init__(self, model: str, config: EngineConfig, info: dict, front: DataParallel):
        replicas = front.router.num_replicas
        self.model_name = model
        self.config = dataclasses.replace(config, max_batch_size=config.max_batch_size * replicas)
        self.front = front
        self.tokenizer = load_tokenizer(model)
        self.model_config = read_model_config(model)
        self.session_len: int = info["session_len"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        self.num_blocks: int = info["num_blocks"]   # each replica's
        self.grammars = Grammars(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)
        self.output_deltas = True

    @property
    def failure(self) -> str | None:
        return self.front.problem()

    def validate(self, prompt_ids) -> None:
        if self.failure:
            raise RequestError(f"the server cannot run the model: {self.failure}")
        check_prompt(prompt_ids, self.model_config.vocab_size, self.session_len)

    def usage(self) -> dict:
        return dict(self.front.snapshot)
