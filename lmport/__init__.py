"""lmport: a pluggable multi-device LLM inference engine."""
from lmport.config import Adjustment, EngineConfig, GenerationConfig
from lmport.errors import ConfigError

__version__ = "0.1.0"

__all__ = ["Adjustment", "ConfigError", "EngineConfig", "GenerationConfig", "pipeline", "__version__"]


def pipeline(model: str = "smollm2", backend_config: EngineConfig | None = None, **kwargs):
    """Load ``model`` and return a :class:`lmport.entrypoints.api.Pipeline` (LMDeploy's name and shape)."""
    from lmport.entrypoints.api import Pipeline
    return Pipeline(model, backend_config=backend_config, **kwargs)
