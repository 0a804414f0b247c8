"""How an embedding is made from a prompt's final hidden states (docs/embeddings.md).

The engine pools (``EngineCore.add_request(..., pooling=...)``): "mean" averages every prompt position's final
hidden state (after the model's last norm), "last" takes the last position's. Which one, and whether the
vector is then L2-normalized, comes from the model's sentence-transformers configuration when its
directory has one (``modules.json`` with a Pooling module, and a Normalize module or not); otherwise the
default is last-token pooling, normalized, as decoder embedding models (E5-Mistral, GTE-Qwen, Qwen3-Embedding)
are trained and as vLLM does for a decoder without that configuration.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from lmport.errors import ConfigError

POOLING_MODES = ("mean", "last")
# sentence-transformers' Pooling config -> lmport's mode: its "pooling_mode" (version 6 on), or one flag a mode
# (before); the other modes are refused.
_ST_MODE_NAMES = {"mean": "mean", "lasttoken": "last"}
_ST_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
_ST_OTHER = ("pooling_mode_cls_token", "pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
             "pooling_mode_weightedmean_tokens")


@dataclass(frozen=True)
class PoolingConfig:
    mode: str = "last"
    normalize: bool = True
    source: str = "default (no sentence-transformers configuration)"


def pooling_config(model_path: Path) -> PoolingConfig:
    """The model's pooling from its sentence-transformers files (a directory's modules.json), else the default."""
    modules_file = model_path / "modules.json" if model_path.is_dir() else None
    if modules_file is None or not modules_file.exists():
        return PoolingConfig()
    try:
        modules = json.loads(modules_file.read_text())
        kinds = {m["type"].rsplit(".", 1)[-1]: m for m in modules}
        if "Pooling" not in kinds:
            return PoolingConfig(normalize="Normalize" in kinds, source=f"{modules_file} (no Pooling module)")
        pool = json.loads((model_path / kinds["Pooling"]["path"] / "config.json").read_text())
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{modules_file}: the sentence-transformers configuration cannot be read ({exc})") from None
    if pool.get("include_prompt") is False:
        raise ConfigError(f"{model_path}: sentence-transformers pooling with include_prompt=false (an instruction "
                          f"prompt left out of the pool) is not served")
    if isinstance(pool.get("pooling_mode"), str):
        name = pool["pooling_mode"]
        modes, other = ([_ST_MODE_NAMES[name]], []) if name in _ST_MODE_NAMES else ([], [f"pooling_mode={name}"])
    else:
        modes = [mode for key, mode in _ST_MODES.items() if pool.get(key)]
        other = [key for key in _ST_OTHER if pool.get(key)]
    if other or len(modes) != 1:
        raise ConfigError(f"{model_path}: sentence-transformers pooling {other or modes or 'none'} is not served; "
                          f"lmport pools by mean or last token (one of them)")
    return PoolingConfig(modes[0], "Normalize" in kinds, source=str(modules_file))


def finish(vector: list[float], config: PoolingConfig) -> list[float]:
    """The pooled vector as served: L2-normalized when the config says so."""
    if not config.normalize:
        return vector
    norm = math.sqrt(math.fsum(x * x for x in vector))
    return [x / norm for x in vector] if norm > 0 else vector
