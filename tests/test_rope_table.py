"""RopeTable (lmport.models.rope_table) against transformers' rotary module called on the positions.

Static rope types are looked up from the table, equal to the module's own cos/sin for the same
positions; types whose frequencies follow the sequence length call the module every step."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from lmport.models.rope_table import RopeTable, rows_depend_on_length

SCALINGS = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


def rotary(kind: str) -> LlamaRotaryEmbedding:
    cfg = LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=1024,
                      rope_scaling=SCALINGS[kind])
    return LlamaRotaryEmbedding(config=cfg)


@pytest.mark.parametrize("kind", list(SCALINGS))
def test_rows_equal_the_modules_own(kind):
    module, table = rotary(kind), RopeTable()
    x = torch.zeros(1, 64)
    for positions in ([5], [0, 1, 2, 3], [700, 3, 299], [1000]):   # 1000 > the first table's rows
        pos = torch.tensor(positions)
        got = table(module, x, pos, max(positions) + 1)
        want = module(x, pos[None])
        torch.testing.assert_close(got[0], want[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], want[1][0], rtol=0, atol=1e-6)
    assert (table.cos is None) == rows_depend_on_length(module) == (kind == "dynamic")


def test_table_grows_to_the_largest_position_and_follows_the_dtype():
    module, table = rotary("default"), RopeTable()
    table(module, torch.zeros(1, 64), torch.tensor([3]), 4)
    assert table.cos is not None and table.cos.shape[0] == RopeTable.MIN_ROWS
    table(module, torch.zeros(1, 64), torch.tensor([600]), 601)
    assert table.cos.shape[0] == 601   # the position needed (more than double the 256 rows it had)
    cos, _ = table(module, torch.zeros(1, 64, dtype=torch.float64), torch.tensor([7]), 8)
    assert cos.dtype == torch.float64


def test_gemma3_layer_types_are_looked_up_from_their_tables():
    """Gemma 3's module keeps a rope type per layer type ({"sliding_attention": "default", ...}): each
    kind's rows come from its own table, equal to the module's own for that kind."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    module = Gemma3RotaryEmbedding(Gemma3TextConfig(hidden_size=64, num_attention_heads=2, head_dim=32,
                                                    num_hidden_layers=6, max_position_embeddings=1024))
    assert isinstance(module.rope_type, dict)
    x, pos = torch.zeros(1, 32), torch.tensor([700, 3, 299])
    for kind in ("sliding_attention", "full_attention"):
        table = RopeTable(kind)
        got = table(module, x, pos, 701)
        assert table.cos is not None and not rows_depend_on_length(module, kind)
        want = module(x, pos[None], kind)
        torch.testing.assert_close(got[0], want[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], want[1][0], rtol=0, atol=1e-6)


def test_longrope_rows_follow_the_calls_largest_position():
    """Phi-3's "longrope": short factors while a call's positions stay below
    original_max_position_embeddings, long ones for every position of a call past it; both from
    tables, equal to the module's own cos/sin for the same call."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    half = 16
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0 + i / 8 for i in range(half)],
            "long_factor": [2.0 + i / 4 for i in range(half)]}
    cfg = Phi3Config(hidden_size=64, num_attention_heads=2, max_position_embeddings=2048,
                     original_max_position_embeddings=512, rope_scaling=rope)
    module, table = Phi3RotaryEmbedding(config=cfg), RopeTable()
    x = torch.zeros(1, 32)
    for positions in ([5], [0, 300, 511], [3, 512], [1500, 7], [9]):
        pos = torch.tensor(positions)
        got = table(module, x, pos, max(positions) + 1)
        want = module(x, pos[None])
        torch.testing.assert_close(got[0], want[0][0], rtol=0, atol=1e-6)
        torch.testing.assert_close(got[1], want[1][0], rtol=0, atol=1e-6)
    short, long = table(module, x, torch.tensor([3]), 4), table(module, x, torch.tensor([3, 600]), 601)
    assert not torch.allclose(short[0][0], long[0][0])   # the two factor sets differ at position 3
