"""``Engine``: the in-process LLM (lmport.engine.llm) under the name it had before the engine core
(lmport.engine.core) was split from it, kept since many callers use it. What the HTTP side reads (outputs,
errors, the prompt check) is lmport.engine.outputs, which imports no model code."""
from lmport.engine.core import EngineCore
from lmport.engine.llm import LLM
from lmport.engine.outputs import RequestError, RequestOutput, check_prompt

Engine = LLM

__all__ = ["LLM", "Engine", "EngineCore", "RequestError", "RequestOutput", "check_prompt"]
