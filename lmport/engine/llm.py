"""The in-process LLM: an engine core (lmport.engine.core) and the output processor that gives its outputs their
text (lmport.engine.output_processor: detokenizing, stop strings).

``LLM`` offers the core's calls (``add_request`` / ``step`` / ``abort``) with outputs of text, and every other
attribute of its core (the scheduler, the block manager, ``usage()``, the LoRA calls) as its own. Served over
HTTP, an LLM serves its core: the front end has its own output processor (lmport.engine.client).
"""
from __future__ import annotations

from lmport.config import EngineConfig, GenerationConfig
from lmport.engine.core import EngineCore
from lmport.engine.output_processor import OutputProcessor
from lmport.engine.outputs import ErrorKind, Failure, FinishReason, RequestOutput
from lmport.platform.backend import Backend


class LLM:
    def __init__(self, model: str = "smollm2", config: EngineConfig | None = None, backend: Backend | None = None):
        self.core = EngineCore(model, config, backend)
        self.output_processor = OutputProcessor(self.core.tokenizer, cumulative=True)

    def __getattr__(self, name: str):
        if name == "core":   # not built yet (a failed __init__)
            raise AttributeError(name)
        return getattr(self.core, name)

    def add_request(self, prompt_ids: list[int], gen_config: GenerationConfig | None = None,
                    request_id: str | None = None, **options) -> str:
        """``EngineCore.add_request``; its outputs get their text."""
        gen_config = gen_config or GenerationConfig()
        request_id = self.core.add_request(prompt_ids, gen_config, request_id, **options)
        self.output_processor.add(request_id, gen_config)
        return request_id

    def abort(self, request_id: str) -> bool:
        return self.core.abort(request_id)

    def step(self) -> list[RequestOutput]:
        """One step of the core, its outputs with their text. A request that a stop string ended (or whose text
        could not be decoded) ends in the core too."""
        outputs, ended = self.output_processor.process(self.core.step())
        for out in ended:
            failure = Failure(out.error, out.error_kind or ErrorKind.ENGINE) if out.error is not None else None
            self.core.finish_request(out.request_id, out.finish_reason or FinishReason.STOP, failure)
        return outputs

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def close(self) -> None:
        self.core.close()
