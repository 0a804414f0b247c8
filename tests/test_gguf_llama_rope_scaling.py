"""A Llama 3.1-style GGUF (llama.cpp's converter writes the llama3-type rope scaling as ``rope_freqs.weight``, a
factor dividing each rotary frequency, not as config keys): lmport's logits on the F32 file against transformers'
model of the source config (its ``rope_parameters``) holding the file's tensors, over a prompt past the scaling's
original context (32 positions in the tiny model), prefilled in chunks. A file read without the factors gives
Llama 3's unscaled rotary and other logits (tests/support/llama_cpp_families.py makes the file)."""
from __future__ import annotations

import torch

from support import greedy
from support.llama_cpp_families import gguf_file, hf_prompt_logits, lmport_prompt_logits, reference_model


def test_a_rope_scaled_llama_file_matches_transformers():
    import lmport
    from lmport import EngineConfig
    path = gguf_file("llama-rope-scaled", "F32")
    ref = reference_model("llama-rope-scaled", path)
    (ids,) = greedy.prompts(1, seed=5, lengths=(70,))
    with lmport.pipeline(str(path), backend_config=EngineConfig(device_type="cpu", dtype="float32",
                                                                cache_max_entry_count=256)) as pipe:
        got = lmport_prompt_logits(pipe.engine, ids, 16)
    torch.testing.assert_close(got, hf_prompt_logits(ref, ids), atol=5e-5, rtol=1e-4)
