"""presence_penalty / frequency_penalty: the engine's tokens equal a reference loop written from OpenAI's formula."""
from __future__ import annotations

import functools

import pytest
import torch

import lmport
from lmport import EngineConfig, GenerationConfig
from lmport.config import ConfigError
from support.model_helpers import hf_model, tiny_model_dir


@functools.cache
def tiny_pipe():
    return lmport.pipeline(tiny_model_dir("llama"), backend_config=EngineConfig(
        device_type="cpu", cache_max_entry_count=64, session_len=512))


def openai_reference(prompt: list[int], steps: int, presence: float, frequency: float,
                     temperature: float = 0.0, seed: int | None = None) -> list[int]:
    """transformers' forward, then OpenAI's documented penalty over the generated tokens:
    mu[j] -= c[j] * frequency_penalty + float(c[j] > 0) * presence_penalty."""
    model = hf_model(tiny_model_dir("llama"))
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    out: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out])).logits[0, -1].float()
            counts = torch.bincount(torch.tensor(out, dtype=torch.long), minlength=logits.numel()).float()
            logits = logits - counts * frequency - (counts > 0).float() * presence
            if generator is None:
                out.append(int(logits.argmax()))
            else:
                # The engine's draw: the exponential race (argmax p / E, E = -log U, U uniform in float64) among
                # chunks of 1024 tokens by their masses, then among the winning chunk's tokens.
                probs = (logits / temperature).softmax(-1).double()
                chunks = probs.view(-1, 1024)
                e = -torch.rand(len(chunks) + 1024, dtype=torch.float64, generator=generator).log()
                chunk = int((chunks.sum(-1) / e[:len(chunks)]).argmax())
                out.append(chunk * 1024 + int((chunks[chunk] / e[len(chunks):]).argmax()))
    return out


def prompt(seed: int) -> list[int]:
    return torch.randint(3, 49152, (12,), generator=torch.Generator().manual_seed(seed)).tolist()


@functools.cache
def plain_greedy(p: tuple[int, ...]) -> list[int]:
    return tiny_pipe().generate([list(p)], GenerationConfig(max_new_tokens=12, ignore_eos=True))[0].token_ids


# Each penalty alone and both together (negative); both positive together runs with the slow tests.
@pytest.mark.parametrize("presence,frequency", [(1.5, 0.0), (0.0, 1.2), pytest.param(0.8, 0.6, marks=pytest.mark.slow),
                                                (-1.0, -0.5)])
def test_greedy_penalties_equal_openai_formula(presence, frequency):
    p = prompt(0)   # this random model's greedy output repeats a token at step 6 of this prompt
    want = openai_reference(p, 12, presence, frequency)
    cfg = GenerationConfig(max_new_tokens=12, ignore_eos=True, presence_penalty=presence, frequency_penalty=frequency)
    assert tiny_pipe().generate([p], cfg)[0].token_ids == want
    assert plain_greedy(tuple(p)) != want, "the penalty should change this random model's repetitive greedy output"


# Two seeds by default (each seed draws another prompt and other uniforms); two more with the slow tests.
@pytest.mark.parametrize("seed", [0, 1, *(pytest.param(s, marks=pytest.mark.slow) for s in (2, 3))])
def test_sampled_penalties_equal_openai_formula_per_seed(seed):
    p = prompt(10 + seed)
    # A low temperature sharpens the random model's flat distribution, so the penalty decides the draws.
    want = openai_reference(p, 10, 0.7, 0.9, temperature=0.05, seed=seed)
    cfg = GenerationConfig(max_new_tokens=10, ignore_eos=True, do_sample=True, temperature=0.05, random_seed=seed,
                           presence_penalty=0.7, frequency_penalty=0.9)
    # Batched with another prompt: each row counts its own generated tokens.
    outs = tiny_pipe().generate([p, prompt(99)], cfg)
    assert outs[0].token_ids == want


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -2.01, "1"])
def test_penalty_range_is_checked(field, value):
    with pytest.raises(ConfigError, match=f"{field} must be a number in \\[-2, 2\\]"):
        GenerationConfig(**{field: value})


def test_logit_bias_is_added_before_sampling_and_checked():
    from lmport.worker.sampling import sample
    from lmport.sched.sequence import Sequence
    logits = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 5.0, 1.0, 2.0]])
    seqs = [Sequence("a", [0], GenerationConfig(logit_bias={1: -100, 3: 4}), frozenset()),
            Sequence("b", [0], GenerationConfig(), frozenset())]
    assert sample(logits, seqs)[0] == [3, 1]
    for bad in ({1: float("nan")}, {-1: 1.0}, {"1": 1.0}, [1]):
        with pytest.raises(ConfigError, match="logit_bias"):
            GenerationConfig(logit_bias=bad)
