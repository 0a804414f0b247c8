"""A structured output's grammar applied after the reply's thinking
(lmport.structured_output.grammar.Matcher with ``reasoning``):
every token while it thinks, blank lines right after it, then only what the grammar allows; rolling back a
speculative proposal across those phases leaves the matcher as if the tokens had never come."""
from __future__ import annotations

import pytest
import xgrammar as xgr
from support.chat_families import EXTRA_VOCAB, family_model_dir

from lmport.structured_output.grammar import Grammars, GuidedDecodingError, grammar_key
from lmport.reasoning import PARSERS

VOCAB = 49152 + EXTRA_VOCAB
FORMAT = {"type": "json_schema", "json_schema": {"name": "a", "schema": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


@pytest.fixture(scope="module")
def setup():
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(family_model_dir())
    return tokenizer, Grammars(tokenizer, VOCAB, [2])


def _mask(matcher) -> xgr.Tensor:
    bitmask = xgr.allocate_token_bitmask(1, VOCAB)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return bitmask[0].clone()


def _allowed(mask, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


def _matcher(setup, inside: bool):
    tokenizer, grammars = setup
    return grammars.matcher({**FORMAT, "reasoning": PARSERS["qwen3"].gate(tokenizer, inside)})


def test_free_while_thinking_blank_lines_after_it_then_the_grammar(setup):
    tokenizer, _ = setup
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)   # noqa: E731
    matcher = _matcher(setup, inside=False)
    think, prose, end, blank, answer = encode("<think>"), encode("free {text"), encode("</think>"), encode("\n\n"), \
        encode('{"a": 1}')
    first = _mask(matcher)   # at the start: the token that opens the thinking, or the grammar's first
    assert _allowed(first, think[0]) and _allowed(first, answer[0]) and not _allowed(first, prose[0])
    for token in think + prose:
        assert matcher.accept_token(token)
        assert bool((_mask(matcher) == -1).all())   # thinking: every token
    for token in end + blank:
        matcher.accept_token(token)
    after = _mask(matcher)
    assert _allowed(after, answer[0]) and _allowed(after, blank[0]) and not _allowed(after, prose[0])
    for token in answer + [2]:   # then the end of the turn
        assert _allowed(_mask(matcher), token) and matcher.accept_token(token)
    assert matcher.is_terminated()


def test_a_reply_that_does_not_think_is_constrained_from_its_first_token(setup):
    tokenizer, _ = setup
    matcher = _matcher(setup, inside=False)
    answer = tokenizer.encode('{"a": 1}', add_special_tokens=False)
    for token in answer + [2]:
        assert matcher.accept_token(token)
    assert matcher.is_terminated()


def test_rolling_back_across_the_phases_is_as_if_the_tokens_never_came(setup):
    tokenizer, _ = setup
    tokens = tokenizer.encode('some thought</think>\n\n{"a": 12}', add_special_tokens=False) + [2]
    for keep in range(len(tokens)):
        rolled = _matcher(setup, inside=True)
        for token in tokens:
            rolled.accept_token(token)
        rolled.rollback(len(tokens) - keep)
        fresh = _matcher(setup, inside=True)
        for token in tokens[:keep]:
            fresh.accept_token(token)
        for token in tokens[keep:]:   # the same masks from here on, and the same end
            assert bool((_mask(rolled) == _mask(fresh)).all()), keep
            assert rolled.accept_token(token) == fresh.accept_token(token)
        assert rolled.is_terminated() and fresh.is_terminated()


@pytest.mark.parametrize("reasoning", [{"end": [], "inside": True}, {"end": [1], "inside": "yes"},
                                       {"end": [1], "inside": True, "start": -1}, "x"])
def test_a_malformed_reasoning_entry_is_refused(reasoning):
    with pytest.raises(GuidedDecodingError, match="response_format.reasoning"):
        grammar_key({**FORMAT, "reasoning": reasoning})
