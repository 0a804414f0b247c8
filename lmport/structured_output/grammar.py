"""Structured outputs: a grammar compiled once per distinct format, a matcher per request, a token mask per step.

``GenerationConfig.response_format`` names the format (LMDeploy's field and
shapes, which follow OpenAI's ``response_format``):

- ``None`` or ``{"type": "text"}``: unconstrained;
- ``{"type": "json_object"}``: any JSON object;
- ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}``;
- ``{"type": "regex_schema", "regex_schema": "<regex>"}``;
- ``{"type": "grammar", "grammar": "<EBNF, GBNF dialect>"}``.

Grammars are xgrammar's (the engine vLLM, SGLang and TensorRT-LLM use).
Each request gets its own matcher, advanced with every token it accepts;
before sampling, the matcher's allowed-token bitmask sets the other tokens'
logits to -inf. The mask is plain torch on whatever device the logits live
on, so no backend needs a kernel for it. Masks are filled on a host thread
while the forward runs (``MaskBuilder.start``).
"""
from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, TimeoutError
from typing import TYPE_CHECKING, cast

import jsonschema

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr
# xgrammar itself is imported where a request first uses a format (a second or more, and tens of MB, that
# an engine serving plain text never pays). torch only in annotations: the tensors come from xgrammar and the
# engine, so the HTTP app, which checks formats with this module, does not load torch.

FORMAT_TYPES = ("text", "json_object", "json_schema", "regex_schema", "grammar")


class GuidedDecodingError(ValueError):
    """A response_format that is malformed or that the grammar engine cannot compile; the message says why."""


def grammar_key(response_format: dict | None) -> tuple[str, str] | None:
    """The format as (kind, canonical text), or None when it constrains nothing; raises on a malformed one.

    Two requests with the same key share one compiled grammar.
    """
    if response_format is None:
        return None
    key = _grammar_key(response_format)
    if key is not None:
        check_budget(*key)
        check_reasoning(response_format.get("reasoning"))
    return key


def check_reasoning(reasoning) -> None:
    """A format's ``reasoning`` entry: None, or {"end": token ids, "start": a token id or None, "inside": bool}
    (lmport.reasoning.ThinkTags.gate): the format applies once the reply's thinking has ended."""
    if reasoning is None:
        return
    ok = (isinstance(reasoning, dict) and isinstance(reasoning.get("end"), list) and reasoning["end"]
          and all(isinstance(t, int) and t >= 0 for t in reasoning["end"])
          and (reasoning.get("start") is None or isinstance(reasoning["start"], int) and reasoning["start"] >= 0)
          and isinstance(reasoning.get("inside"), bool))
    if not ok:
        raise GuidedDecodingError('response_format.reasoning must be {"end": [token ids], "start": a token id or '
                                  f'null, "inside": true or false}}, got {_short(reasoning)}')


# What one format may ask of the compiler: xgrammar's time and memory grow faster than linearly with
# these (thousands of optional properties took a minute and GBs; 60k EBNF rules 5 GB).
MAX_FORMAT_CHARS = 64 * 1024    # the schema's JSON, the regex or the grammar
MAX_GRAMMAR_RULES = 1000
MAX_PROPERTIES = 512            # properties of all objects in a schema together
MAX_ENUM_VALUES = 1000          # enum values of a schema together; guided_choice entries


def check_budget(kind: str, text: str) -> None:
    where = f"response_format.{'json_schema.schema' if kind == 'json_schema' else kind}"
    if len(text) > MAX_FORMAT_CHARS:
        raise GuidedDecodingError(f"{where}: {len(text)} characters is more than the {MAX_FORMAT_CHARS} the server "
                                  f"compiles; simplify it")
    if kind == "grammar" and (rules := len(re.findall(r"::=", text))) > MAX_GRAMMAR_RULES:
        raise GuidedDecodingError(f"{where}: {rules} rules is more than the {MAX_GRAMMAR_RULES} the server compiles; "
                                  f"simplify the grammar")
    if kind == "regex_schema" and (choices := text.count("|") + 1) > MAX_ENUM_VALUES:
        raise GuidedDecodingError(f"{where}: {choices} alternatives is more than the {MAX_ENUM_VALUES} the server "
                                  f"compiles; give fewer")
    if kind == "json_schema":
        properties = enums = 0
        for _, node in _walk(json.loads(text), ""):
            if isinstance(node.get("properties"), dict):
                properties += len(node["properties"])
            if isinstance(node.get("enum"), list):
                enums += len(node["enum"])
        for count, limit, what in ((properties, MAX_PROPERTIES, "properties"), (enums, MAX_ENUM_VALUES,
                                                                              "enum values")):
            if count > limit:
                raise GuidedDecodingError(f"{where}: {count} {what} is more than the {limit} the server compiles; "
                                          f"simplify the schema")


def _grammar_key(response_format: dict) -> tuple[str, str] | None:
    if not isinstance(response_format, dict) or response_format.get("type") not in FORMAT_TYPES:
        raise GuidedDecodingError(f"response_format must be an object whose type is one of {', '.join(FORMAT_TYPES)}"
                                  f", got {_short(response_format)}")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        # llama.cpp's extension: a schema beside json_object constrains like json_schema does.
        schema = response_format.get("schema", {"type": "object"})
        if not isinstance(schema, (dict, bool)):
            raise GuidedDecodingError(f"response_format.schema must be a JSON schema object, got {_short(schema)}")
        check_schema(schema)
        return ("json_schema", json.dumps(schema))
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), (dict, bool)):
            raise GuidedDecodingError('response_format.json_schema must be {"name": ..., "schema": {...}}, '
                                      f"got {_short(spec)}")
        # OpenAI allows the schema to be left out: any JSON then.
        schema = spec.get("schema", {})
        check_schema(schema)
        # Key order kept: the output follows the schema's property order.
        return ("json_schema", json.dumps(schema))
    text = response_format.get(kind)
    if not isinstance(text, str) or not text:
        raise GuidedDecodingError(f"response_format.{kind} must be a non-empty string, got {_short(text)}")
    if kind == "regex_schema":
        check_repeats(text, f"response_format.{kind}")
    return (kind, text)


MAX_REPEAT = 10_000   # a regex count above it would be expanded into that many grammar states (and xgrammar
                      # reads counts as 32-bit: a{4294967297} silently became a{1})
REPEAT = re.compile(r"(?<!\\)\{\s*([0-9]+)\s*(?:,\s*([0-9]*)\s*)?\}")


def check_repeats(regex: str, where: str) -> None:
    for m in REPEAT.finditer(regex):
        for count in m.groups():
            if count and int(count) > MAX_REPEAT:
                raise GuidedDecodingError(f"{where}: the repetition {_short(m.group(0))} counts beyond "
                                          f"{MAX_REPEAT}; use * or + for an unbounded count")


def check_ambiguity(ebnf: str) -> None:
    """Refuse a grammar with a rule that is only itself, repeated (``x ::= x x``): every output then parses in
    exponentially many ways and the parser's cost grows with each token (a mask of seconds within a hundred
    tokens). Rules ambiguous in subtler ways are ended at run time by the grammar budget instead."""
    import xgrammar as xgr
    try:
        normalized = str(xgr.Grammar.from_ebnf(ebnf))   # one rule a line, each alternative in parentheses
    except Exception:
        return   # a syntax error: the compile reports it
    for line in normalized.splitlines():
        name, sep, body = line.partition(" ::= ")
        if not sep:
            continue
        body = re.sub(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]', '""', body)   # literals and classes
        for alternative in re.findall(r"\(([^()]*)\)", body):
            parts = alternative.split()
            if len(parts) >= 2 and all(part == name for part in parts):
                raise GuidedDecodingError(
                    f"response_format.grammar: rule {name} ::= {alternative} | ... is ambiguous (an output of n "
                    f"pieces parses in exponentially many ways, and the cost of every token grows with the "
                    f"output): write a repetition instead, e.g. {name} ::= (\"a\" | \"b\")*")


# Keywords xgrammar would silently ignore (its output could then break the schema): refused instead.
UNSUPPORTED_KEYWORDS = ("not", "if", "then", "else", "dependentSchemas", "dependencies", "unevaluatedProperties",
                        "unevaluatedItems")


def check_schema(schema) -> None:
    """A valid JSON schema (draft 2020-12 meta-schema) using only what the grammar engine enforces."""
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path)
        raise GuidedDecodingError(f"response_format.json_schema.schema is not a valid JSON schema"
                                  f"{f' at {where}' if where else ''}: {exc.message}") from None
    for path, node in _walk(schema, ""):
        where = f"response_format.json_schema.schema{path}"
        if isinstance(node.get("pattern"), str):
            check_repeats(node["pattern"], f"{where}/pattern")
        props = node.get("properties") if isinstance(node.get("properties"), dict) else {}
        if node.get("additionalProperties") is False and not node.get("patternProperties"):
            missing = [n for n in node.get("required", []) if n not in props]
            if missing:
                raise GuidedDecodingError(f"{where}: required {', '.join(map(repr, missing[:5]))} is not among "
                                          f"the properties and additionalProperties is false, so no object can "
                                          f"match; add it to properties or drop it from required")
        lengths = [k for k in ("minLength", "maxLength") if k in node]
        if lengths and ("pattern" in node or "format" in node):   # xgrammar drops the length then
            other = "pattern" if "pattern" in node else "format"
            raise GuidedDecodingError(f"{where}: {' and '.join(lengths)} beside {other} is not enforced by the "
                                      f"grammar engine; fold the length into the pattern (e.g. ^[a-z]{{1,8}}$) "
                                      f"or leave one out")
        used = [k for k in UNSUPPORTED_KEYWORDS if k in node]
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            used.append(f"$ref to {ref!r} (only local #/... references)")
        if used:
            raise GuidedDecodingError(f"response_format.json_schema.schema{path}: {', '.join(used)} is not supported "
                                      f"by the grammar engine; leave it out")


SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
VALUE_KEYS = ("enum", "const", "default", "examples", "required")   # JSON values, not schemas


def enforceable_schema(schema):
    """The schema with what xgrammar would compile loosely rewritten into a form it enforces.

    A string with minLength/maxLength and no pattern compiles in xgrammar 0.2 to a bare character class that
    admits raw control characters (U+0000-U+001F), which JSON forbids unescaped, so a "stop" output failed to
    parse (mlc-ai/xgrammar#800). As a pattern it goes through xgrammar's JSON-string regex, which refuses them:
    ``^.{min,max}$`` means the same length. Like the class it replaces, it emits no escape sequences.
    """
    if isinstance(schema, list):
        return [enforceable_schema(v) for v in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):   # names to schemas, not a schema itself
            out[key] = {name: enforceable_schema(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in VALUE_KEYS else enforceable_schema(value)
    if (out.get("type") == "string" and ("minLength" in out or "maxLength" in out)
            and "pattern" not in out and "format" not in out):
        low, high = out.pop("minLength", 0), out.pop("maxLength", "")
        out["pattern"] = f"^.{{{low},{high}}}$"
    return out


def _walk(node, path):
    """Every schema object inside ``node``, with its path; maps of names to schemas are not schemas themselves."""
    if isinstance(node, dict):
        yield path, node
        for key, value in node.items():
            if key in SCHEMA_MAPS and isinstance(value, dict):
                for name, sub in value.items():
                    yield from _walk(sub, f"{path}/{key}/{name}")
            elif key not in VALUE_KEYS:
                yield from _walk(value, f"{path}/{key}")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _walk(value, f"{path}/{i}")


MASK_BUDGET_S = 0.1   # seconds a row's token mask (or one accept_token) may take in a step
# CPU seconds one request's grammar may spend in all (masks and accepted tokens together). A JSON schema or
# regex spends well under a millisecond a token; an ambiguous grammar's cost grows with every token (each
# mask a little slower than the last, and the parser's state with it), so it meets this bound within a few
# seconds and a bounded amount of parser memory, however many tokens it asked for.
GRAMMAR_BUDGET_S = 2.0
# The start of an engine error that is the request's own fault (its format), not the server's: the server
# answers it as a 4xx (its kind is lmport.engine.outputs.ErrorKind.REQUEST; this start is the message's wording).
FORMAT_FAULT = "response_format: "


class Grammars:
    """xgrammar's tokenizer view and compiler for one model; compiled grammars cached by grammar_key.

    Thread-safe: the server compiles a request's grammar (to refuse a bad one with a 400) on its
    own thread while the engine thread compiles for add_request.
    """

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int], max_cached: int = 256,
                 budget: float = GRAMMAR_BUDGET_S):
        self.vocab_size = vocab_size
        self.budget = budget   # CPU seconds each request's matcher may spend (Matcher)
        self.stop_token_ids = sorted(stop_token_ids)
        self._tokenizer = tokenizer
        self._compiler: xgr.GrammarCompiler | None = None   # made by the first format compiled
        self._info: xgr.TokenizerInfo | None = None
        self._blank: torch.Tensor | None = None
        # Least recently used first; at most max_cached grammars are kept.
        self._cache: OrderedDict[tuple[str, str], xgr.CompiledGrammar] = OrderedDict()
        self.max_cached = max_cached
        self._lock = threading.Lock()
        self.compiles = 0   # grammars compiled so far (the rest were cache hits)

    def compile(self, response_format: dict | None) -> xgr.CompiledGrammar | None:
        key = grammar_key(response_format)
        if key is None:
            return None
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        if key[0] == "grammar":
            check_ambiguity(key[1])
        compiler = self.compiler   # outside the try: a vocabulary xgrammar cannot read is no bad format
        try:
            compiled = self._compile(compiler, *key)
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with its parser's message
            raise GuidedDecodingError(f"response_format: the {key[0]} cannot be compiled: {_reason(exc)}") from None
        if not self._can_start(compiled):
            raise GuidedDecodingError(f"response_format: the {key[0]} matches no output at all (every rule "
                                      f"needs itself, or a reference never reaches a value): fix the {key[0]}")
        with self._lock:
            self.compiles += key not in self._cache
            compiled = self._cache.setdefault(key, compiled)
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
            return compiled

    @property
    def compiler(self) -> xgr.GrammarCompiler:
        """xgrammar's compiler over the model's vocabulary, made on first use."""
        with self._lock:
            if self._compiler is None:
                import xgrammar as xgr
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, cache_enabled=False)   # ours is keyed by format
                self._info = info
            return self._compiler

    @property
    def blank_tokens(self) -> torch.Tensor:
        """A bitmask row [ceil(V / 32)] of the tokens that are only spaces and line breaks (made on first use)."""
        if self._blank is None:
            self.compiler   # noqa: B018 (makes the tokenizer's view)
            import xgrammar as xgr
            row = xgr.allocate_token_bitmask(1, self.vocab_size)[0].zero_()
            for token, text in enumerate(self._info.decoded_vocab):
                if text and not text.strip(b" \t\r\n"):
                    row[token // 32] |= (1 << token % 32) - (1 << 32 if token % 32 == 31 else 0)
            self._blank = row
        return self._blank

    def _can_start(self, compiled: xgr.CompiledGrammar) -> bool:
        """Whether any first token is allowed (an unsatisfiable format allows none, and would emit end tokens
        to the length limit)."""
        import xgrammar as xgr
        matcher = xgr.GrammarMatcher(compiled)
        bitmask = xgr.allocate_token_bitmask(1, self.vocab_size)
        matcher.fill_next_token_bitmask(bitmask, 0)
        return bool(bitmask.any()) or matcher.is_terminated()

    @staticmethod
    def _compile(compiler: xgr.GrammarCompiler, kind: str, text: str) -> xgr.CompiledGrammar:
        if kind == "json_schema":
            # Fixed separators and no free whitespace: a model cannot wander off into endless blanks.
            schema = json.dumps(enforceable_schema(json.loads(text)))
            return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
        if kind == "regex_schema":
            return compiler.compile_regex(text)
        return compiler.compile_grammar(text)

    def matcher(self, response_format: dict | None) -> Matcher | None:
        compiled = self.compile(response_format)
        if compiled is None:
            return None
        import xgrammar as xgr
        reasoning = cast(dict, response_format).get("reasoning")
        if reasoning is None:
            return Matcher(xgr.GrammarMatcher(compiled), self.budget)
        return Matcher(xgr.GrammarMatcher(compiled), self.budget, reasoning=reasoning, blank=self.blank_tokens)


class GrammarBudgetExceeded(GuidedDecodingError):
    """A request's grammar spent more CPU time than GRAMMAR_BUDGET_S on masks and accepted tokens."""


class Matcher:
    """A request's xgrammar matcher, with the CPU time its grammar has spent; past ``budget`` it raises.

    CPU time of the calling thread (``time.thread_time``), not wall time: a loaded machine does not make a
    cheap grammar look costly. xgrammar fills and advances on the calling thread with the GIL released.

    With ``reasoning`` (check_reasoning), the grammar constrains only the answer, as vLLM's does: while the
    reply thinks every token is allowed, and the grammar starts after the tokens that end the thinking. A reply
    that may open its thinking itself ("inside" false, a "start" token) may take that token or the grammar's
    first ones at its start. Right after the thinking, up to MAX_GAP tokens of only spaces and line breaks
    (``blank``: their bitmask row) may come before the grammar's first token, as models write a blank line
    after ``</think>``.
    """
    MAX_GAP = 4

    def __init__(self, matcher: xgr.GrammarMatcher, budget: float = GRAMMAR_BUDGET_S, reasoning: dict | None = None,
                 blank: torch.Tensor | None = None):
        self.matcher, self.budget, self.spent = matcher, budget, 0.0
        self.blank, self.gap = blank, 0            # blank tokens taken after the thinking so far
        self.end: tuple[int, ...] = tuple(reasoning["end"]) if reasoning else ()
        self.start: int | None = reasoning.get("start") if reasoning else None
        self.phase = "answer" if not reasoning else "reasoning" if reasoning["inside"] else \
            "start" if self.start is not None else "answer"
        self.thought: list[int] = []                 # the thinking's tokens so far (its end is found in them)
        self.log: list[tuple[str, bool]] = []        # each accepted token: the phase before it, whether the
                                                     # grammar took it (to roll back a rejected proposal)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.phase == "reasoning":
            bitmask[row] = -1   # every token
            return
        started = time.thread_time()
        self.matcher.fill_next_token_bitmask(bitmask, row)
        self._charge(time.thread_time() - started)
        if self.phase == "start":   # or the token that opens the thinking
            word, bit = divmod(cast(int, self.start), 32)
            if word < bitmask.shape[-1]:
                bitmask[row, word] |= (1 << bit) - (1 << 32 if bit == 31 else 0)
        elif self.phase == "gap":   # or a blank token before the answer
            bitmask[row] |= cast("torch.Tensor", self.blank).to(bitmask.device)

    def accept_token(self, token: int) -> bool:
        phase = self.phase
        if phase == "reasoning" or phase == "start" and token == self.start:
            self.log.append((phase, False))
            if phase == "start":
                self.phase = "reasoning"
            else:
                self.thought.append(token)
                if tuple(self.thought[-len(self.end):]) == self.end:
                    self.phase = "gap" if self.blank is not None else "answer"
            return True
        if phase == "gap" and self._blank(token):
            self.log.append((phase, False))
            self.gap += 1
            if self.gap == self.MAX_GAP:
                self.phase = "answer"
            return True
        started = time.thread_time()
        accepted = self.matcher.accept_token(token)
        self._charge(time.thread_time() - started)
        if accepted:
            self.log.append((phase, True))
            self.phase = "answer"
        return accepted

    def is_terminated(self) -> bool:
        return self.phase in ("answer", "gap") and self.matcher.is_terminated()

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        undone = self.log[-num_tokens:]
        del self.log[-num_tokens:]
        if granted := sum(taken for _, taken in undone):
            self.matcher.rollback(granted)
        thought = sum(phase == "reasoning" for phase, _ in undone)
        if thought:
            del self.thought[-thought:]
        self.gap -= sum(phase == "gap" and not taken for phase, taken in undone)
        self.phase = undone[0][0]

    def _blank(self, token: int) -> bool:
        blank = cast("torch.Tensor", self.blank)
        return token // 32 < blank.shape[0] and bool((int(blank[token // 32]) >> (token % 32)) & 1)

    def proposal_bitmask(self, proposal: list[int], vocab_size: int
                         ) -> tuple[list[int], torch.Tensor, int | None]:
        """(rows filled, bitmask [len(proposal) + 1, ceil(V / 32)], dead end) for verifying a speculative
        proposal: row j allows what may follow the output and the first j proposed tokens.

        Filling stops at a proposed token the grammar refuses (its row gives it probability 0, so the
        verification rejects it) or after one that ends the grammar (the request ends there): no later row is
        judged. ``dead end``: the first row no token may take, else None; a token judged there could not be
        emitted (the request ends with the dead end after the tokens before it, as it would without
        speculation). The matcher is left as it was; the engine advances it over the tokens emitted.
        """
        import xgrammar as xgr
        bitmask = xgr.allocate_token_bitmask(len(proposal) + 1, vocab_size)
        rows: list[int] = []
        advanced = 0
        try:
            for row in range(len(proposal) + 1):
                if row:
                    if not self.accept_token(proposal[row - 1]):
                        break
                    advanced += 1
                    if self.is_terminated():
                        break
                self.fill_next_token_bitmask(bitmask, row)
                if not bitmask[row].any():
                    return rows, bitmask, row
                rows.append(row)
        finally:
            if advanced:
                self.rollback(advanced)
        return rows, bitmask, None

    def _charge(self, seconds: float) -> None:
        self.spent += seconds
        if self.spent > self.budget:
            raise GrammarBudgetExceeded(
                f"the grammar spent over {self.budget:.1f} s of CPU time on this request's token masks (an "
                f"ambiguous grammar's cost grows with every token): make it unambiguous, e.g. a repetition "
                f"such as x ::= (\"a\" | \"b\")* instead of x ::= x x | ...")


class MaskTimeout(GuidedDecodingError):
    """A grammar took longer than its budget to build a token mask (an ambiguous grammar's cost grows)."""


DEAD_END = ("the format reached a dead end: no token can continue the output and the format cannot end here; "
            "check the schema, regex or grammar against what the model's vocabulary can spell")


class FormatDeadEnd(GuidedDecodingError):
    """The output so far can be neither continued nor ended by any token in the vocabulary (a format that
    xgrammar could not tell was unsatisfiable before generation, e.g. a character no token spells)."""


class Masks:
    """One step's masks: each constrained row filled by its own task, so a slow row cannot hold the others."""

    def __init__(self, num_rows: int, rows: list[int], futures: list[Future], clocks: list[FillClock | None],
                 bitmask: torch.Tensor, budget: float):
        self.num_rows, self.rows, self.futures, self.clocks = num_rows, rows, futures, clocks
        self.bitmask, self.budget = bitmask, budget

    def result(self) -> tuple[list[int], torch.Tensor, dict[int, str]]:
        """(constrained rows, bitmask [B, ceil(V / 32)] int32, {row: why it has no mask}).

        Waits for each row's fill until its thread has spent ``budget`` seconds of CPU time on it; a row still
        filling then is given up (its request ends with the reason) and the step goes on without it. CPU time,
        not wall time: on a loaded machine a cheap fill that waits for a core is not a costly grammar. xgrammar
        releases the GIL while it fills, so a fill given up on only keeps one worker busy until it returns.
        """
        overdue: dict[int, str] = {}
        for i, (row, future) in enumerate(zip(self.rows, self.futures)):
            while True:
                clock = self.clocks[i]   # None: queued behind other rows' fills
                left = self.budget - clock.spent() if clock is not None else 0.005
                try:
                    future.result(timeout=max(left, 0.001))
                    break
                except GuidedDecodingError as exc:   # a dead end, or the grammar over its budget
                    overdue[row] = str(exc)
                    break
                except TimeoutError:
                    if clock is not None and clock.spent() >= self.budget and not future.done():
                        overdue[row] = (f"the grammar took over {self.budget * 1000:.0f} ms to build one token "
                                        f"mask (an ambiguous grammar's cost grows with the output): simplify it")
                        break
                except Exception as exc:  # a matcher that raises ends its own request
                    overdue[row] = f"the grammar failed to build a token mask: {type(exc).__name__}: {exc}"
                    break
        return self.rows, self.bitmask, overdue


class FillClock:
    """The CPU time a worker thread has spent since this was made, readable from another thread (so the step
    can bound a fill still running). Where the platform has no per-thread clock, wall time."""

    def __init__(self):
        try:
            clock = time.pthread_getcpuclockid(threading.get_ident())
            self._now = lambda: time.clock_gettime(clock)
        except (AttributeError, OSError):
            self._now = time.perf_counter
        self._start = self._now()

    def spent(self) -> float:
        try:
            return self._now() - self._start
        except OSError:   # the thread has ended, so its fill is done
            return 0.0


class MaskBuilder:
    """Fills the allowed-token bitmasks of a step's constrained sequences on host threads, one task a row."""

    def __init__(self, vocab_size: int, budget: float = MASK_BUDGET_S, workers: int = 4):
        self.vocab_size = vocab_size
        self.budget = budget
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="lmport-grammar")

    def start(self, matchers: list[Matcher | None]) -> Masks | None:
        """Begin filling masks for rows whose matcher is not None; None when no row is constrained."""
        if all(m is None for m in matchers):
            return None
        import xgrammar as xgr
        rows = [i for i, m in enumerate(matchers) if m is not None]
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        clocks: list[FillClock | None] = [None] * len(rows)

        def fill(k: int, row: int, matcher: Matcher) -> None:
            clocks[k] = FillClock()
            matcher.fill_next_token_bitmask(bitmask, row)
            if not bitmask[row].any():   # sampling would pick among -inf logits: end the request instead
                raise FormatDeadEnd(DEAD_END)

        futures = [self._pool.submit(fill, k, row, matchers[row]) for k, row in enumerate(rows)]
        return Masks(len(matchers), rows, futures, clocks, bitmask, self.budget)

    def start_proposals(self, matchers: list[Matcher], proposals: list[list[int]]) -> list[Future]:
        """Begin filling each constrained proposal's verification masks (``Matcher.proposal_bitmask``), one task
        a proposal; each future gives (rows, bitmask, dead end) or raises what the matcher raised."""
        return [self._pool.submit(m.proposal_bitmask, p, self.vocab_size) for m, p in zip(matchers, proposals)]


# Devices xgrammar has a masking kernel for; on any other, its pure-torch implementation.
KERNEL_DEVICES = ("cpu", "cuda")


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of logits [B, V] whose ``rows`` have every token their bitmask row forbids at -inf.

    Bit t % 32 of word t // 32 allows token t. A copy: the caller's logits still give the model's
    own distribution (for logprobs).
    """
    import xgrammar as xgr
    logits = logits.clone()
    backend = "auto" if logits.device.type in KERNEL_DEVICES else "torch_native"
    xgr.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True),
                                    vocab_size=logits.shape[-1], indices=rows, backend=backend)
    return logits


def _reason(exc: Exception) -> str:
    """xgrammar's message without its "[time] file.cc:line:" prefix."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", lines[0]).strip()


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
