"""Tool-call formats other than Hermes', each as its family's models write calls.

Each format finds where a reply's calls begin (``markers``; for some, only at the reply's very start), reads
the calls from there to the end (``read``: name and arguments as JSON text, or None when the text is no call
the format knows), writes calls as text for a template that cannot (``render``), and, for a forced call,
builds the grammar of one call in its own format (``grammar``). Formats that write a parameter's value as
text or as a Python literal constrain the parameters whose schema that text can state, and refuse the others
(``Unconstrainable``, naming the parameter).
"""
from __future__ import annotations

import ast
import json
import re
import uuid


class Unconstrainable(ValueError):
    """A forced call's grammar cannot state a parameter's schema in the format's text (the message says which)."""


class ToolFormat:
    name = ""
    markers: tuple[str, ...] = ()
    at_start = False      # calls are the whole reply (the marker, if any, comes first)
    example = ""          # one call as the format writes it, for a template that teaches none
    spans_reasoning = False   # a forced call's grammar spells the whole reply, its reasoning included

    def read(self, text: str, schemas: dict[str, dict]) -> list[tuple[str, str]] | None:
        """The calls in ``text`` (which starts at a marker): [(name, arguments JSON text)], or None.
        ``schemas``: each tool's parameters, by name (a format whose values are text reads them by type)."""
        raise NotImplementedError

    def render(self, calls: list[dict]) -> str:
        """Calls ({"name", "arguments": dict}) as this format writes them."""
        raise NotImplementedError

    def grammar(self, functions: list[dict]):
        """An xgrammar Grammar of one call to any of ``functions`` in this format (Unconstrainable: a parameter
        this format cannot constrain)."""
        raise NotImplementedError

    def call_id(self) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def start(self, text: str) -> int | None:
        """Where the calls begin in ``text``, or None."""
        if self.at_start:
            head = len(text) - len(text.lstrip())
            return head if any(text.startswith(m, head) for m in self.markers) else None
        found = [i for m in self.markers if (i := text.find(m)) >= 0]
        return min(found) if found else None


def _json_objects(text: str) -> list | None:
    """The JSON values ``text`` holds one after another (whitespace or ``;`` between them), or None."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return None
        values.append(value)


def _named(objects, key: str) -> list[tuple[str, str]] | None:
    calls = []
    for obj in objects:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        arguments = obj.get(key, obj.get("arguments", {}))
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((obj["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


ARGS = "#/$defs/arguments"   # where a call's schema puts a function's parameters, so their own references resolve


def rebase(node):
    """A schema's local references (``#/$defs/x``, ``#``) made to point into it at ARGS."""
    if isinstance(node, dict):
        return {k: (ARGS + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebase(v))
                for k, v in node.items()}
    if isinstance(node, list):
        return [rebase(v) for v in node]
    return node


def _call_schema(name: str, key: str, parameters: dict) -> str:
    from lmport.structured_output.grammar import enforceable_schema
    return json.dumps({"type": "object", "properties": {"name": {"const": name}, key: {"$ref": ARGS}},
                       "required": ["name", key],
                       "$defs": {ARGS.rsplit("/", 1)[1]: enforceable_schema(rebase(parameters))}})


def _arguments_schema(parameters: dict) -> str:
    from lmport.structured_output.grammar import enforceable_schema
    return json.dumps(enforceable_schema(parameters))


def _literal(text: str):
    import xgrammar as xgr
    return xgr.Grammar.from_ebnf(f"root ::= {json.dumps(text)}")


def _union(grammars: list):
    import xgrammar as xgr
    return grammars[0] if len(grammars) == 1 else xgr.Grammar.union(*grammars)


def _concat(grammars: list):
    import xgrammar as xgr
    return grammars[0] if len(grammars) == 1 else xgr.Grammar.concat(*grammars)


def _optional(grammar):
    return _union([grammar, _literal("")])


def _parameters(function: dict, fmt: str) -> list[tuple[str, dict, bool]]:
    """A function's parameters as (name, schema, required), their own ``$ref``s resolved, in schema order."""
    parameters = function["parameters"]
    if parameters.get("type", "object") != "object" or parameters.get("additionalProperties") not in (None, False) \
            and not parameters.get("properties"):
        raise Unconstrainable(f"{function['name']}: the {fmt} format writes named parameters; give its "
                              f"parameters as an object with properties")
    defs, required = parameters.get("$defs", {}), set(parameters.get("required", []))
    out = []
    for key, schema in parameters.get("properties", {}).items():
        ref = schema.get("$ref", "") if isinstance(schema, dict) else ""
        if ref.startswith("#/$defs/") and ref[len("#/$defs/"):] in defs:
            schema = defs[ref[len("#/$defs/"):]]
        out.append((key, schema, key in required))
    return out


def _parameter_error(function: dict, key: str, fmt: str, why: str) -> Unconstrainable:
    return Unconstrainable(f"{function['name']}.{key}: the {fmt} format writes this parameter's value as "
                           f"{why}; give it one type (string, integer, number, boolean, object or array), or use "
                           f"tool_choice auto")


STRING_CHECKS = ("pattern", "format", "minLength", "maxLength")


def _text_value(function: dict, key: str, schema: dict, fmt: str):
    """A parameter's value as Qwen3-Coder and GLM-4.5 write it: a string as plain text (no ``<``, which would
    open the closing tag), any other type as JSON."""
    import xgrammar as xgr
    kind = schema.get("type") if isinstance(schema, dict) else None
    if kind == "string":
        choices = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if choices is not None:
            if not all(isinstance(c, str) and "<" not in c for c in choices):
                raise _parameter_error(function, key, fmt, "text, and its choices are not all text without '<'")
            return _union([_literal(c) for c in choices])
        if "pattern" in schema or "format" in schema:
            raise _parameter_error(function, key, fmt, "plain text, which a pattern or format cannot constrain")
        low, high = schema.get("minLength", 0), schema.get("maxLength", "")
        return xgr.Grammar.from_regex(f"[^<]{{{low},{high}}}")
    if kind not in ("integer", "number", "boolean", "object", "array", "null"):
        raise _parameter_error(function, key, fmt, "text when its type is string and as JSON otherwise")
    return xgr.Grammar.from_json_schema(_arguments_schema(schema), any_whitespace=False, strict_mode=True)


def _keyword_grammar(function: dict, fmt: str, piece, separator: str = ""):
    """The parameters of one call, each ``piece(key, schema)`` (required ones always, optional ones when the
    model writes them), in schema order, ``separator`` between two."""
    params = _parameters(function, fmt)
    pieces = [(piece(key, schema), needed) for key, schema, needed in params]
    if not separator:
        return _concat([g if needed else _optional(g) for g, needed in pieces]) if pieces else _literal("")
    import xgrammar as xgr

    def after_first(rest):   # the pieces that may follow one written piece, each led by the separator
        return [xgr.Grammar.concat(_literal(separator), g) if needed else
                _optional(xgr.Grammar.concat(_literal(separator), g)) for g, needed in rest]
    first_required = next((i for i, (_, needed) in enumerate(pieces) if needed), None)
    if first_required is not None:   # optional pieces before it would need a separator after them: put it first
        head, rest = pieces[first_required], pieces[:first_required] + pieces[first_required + 1:]
        return _concat([head[0], *after_first(rest)])
    # All optional: none, or any piece first and the later ones after it.
    return _union([_literal("")] + [_concat([g, *after_first(pieces[i + 1:])]) for i, (g, _) in enumerate(pieces)])


class Llama3Json(ToolFormat):
    """Llama 3.1-3.3: the reply is ``{"name": ..., "parameters": {...}}`` (after ``<|python_tag|>`` at times);
    several calls are separated by ``;``."""
    name = "llama3_json"
    markers = ("<|python_tag|>", "{")
    at_start = True
    example = '{"name": <function-name>, "parameters": <arguments-json-object>}'

    def read(self, text, schemas):
        text = text.lstrip()
        text = text[len("<|python_tag|>"):] if text.startswith("<|python_tag|>") else text
        objects = _json_objects(text)
        return None if objects is None else _named(objects, "parameters")

    def render(self, calls):
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}, ensure_ascii=False)
                         for c in calls)

    def grammar(self, functions):
        import xgrammar as xgr
        return _union([xgr.Grammar.from_json_schema(_call_schema(f["name"], "parameters", f["parameters"]),
                                                    any_whitespace=False, strict_mode=True) for f in functions])


class Mistral(ToolFormat):
    """Mistral (v3 tokenizer, Nemo): ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``. Newer releases
    write ``[TOOL_CALLS]name[ARGS]{...}``; both are read. ``[TOOL_CALLS]`` is a special token in Mistral's
    tokenizers, which the decoded reply leaves out: a list of calls without it is read too (text that is not
    calls to the given tools stays text). Call ids are 9 letters and digits, as its templates require."""
    name = "mistral"
    markers = ("[TOOL_CALLS]", "[{")
    example = '[TOOL_CALLS][{"name": <function-name>, "arguments": <arguments-json-object>}]'

    def read(self, text, schemas):
        calls = []
        parts = text.split("[TOOL_CALLS]")[1:] if text.startswith("[TOOL_CALLS]") else [text]
        for part in parts:
            if "[ARGS]" in part:
                name, _, arguments = part.partition("[ARGS]")
                objects = _json_objects(arguments)
                if objects is None or len(objects) != 1:
                    return None
                found = _named([{"name": name.strip(), "arguments": objects[0]}], "arguments")
            else:
                objects = _json_objects(part)
                if not objects or len(objects) != 1 or not isinstance(objects[0], list):
                    return None
                found = _named(objects[0], "arguments")
            if found is None:
                return None
            calls += found
        return calls or None

    def render(self, calls):
        return "[TOOL_CALLS]" + json.dumps([{"name": c["name"], "arguments": c["arguments"]} for c in calls],
                                           ensure_ascii=False)

    def grammar(self, functions):
        import xgrammar as xgr
        return xgr.Grammar.concat(_literal("[TOOL_CALLS]["), _union([
            xgr.Grammar.from_json_schema(_call_schema(f["name"], "arguments", f["parameters"]), any_whitespace=False,
                                         strict_mode=True) for f in functions]), _literal("]"))

    def call_id(self) -> str:
        return uuid.uuid4().hex[:9]


CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
# V3: <｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\nARGS\n```<｜tool▁call▁end｜>
# V3.1: <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>ARGS<｜tool▁call▁end｜>
DEEPSEEK_CALL = re.compile(re.escape(CALL_BEGIN) + r"(?:function" + re.escape(SEP) + r"(?P<v3name>[^\n]+)\n```json\n"
                           r"(?P<v3args>.*?)\n```|(?P<name>.*?)" + re.escape(SEP) + r"(?P<args>.*?))"
                           + re.escape(CALL_END), re.S)


class DeepSeekV3(ToolFormat):
    """DeepSeek-V3 / R1 (``function<｜tool▁sep｜>NAME`` and a fenced JSON block) and, read alike, V3.1's
    shorter ``NAME<｜tool▁sep｜>ARGS``; calls between ``<｜tool▁calls▁begin｜>`` and ``<｜tool▁calls▁end｜>``."""
    name = "deepseek_v3"
    markers = (CALLS_BEGIN,)
    example = (f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}<function-name>\n```json\n<arguments-json-object>\n```"
               f"{CALL_END}{CALLS_END}")
    v31 = False

    def read(self, text, schemas):
        body = text[len(CALLS_BEGIN):]
        body = body[:body.index(CALLS_END)] if CALLS_END in body else body
        calls, at = [], 0
        for m in DEEPSEEK_CALL.finditer(body):
            if body[at:m.start()].strip():
                return None
            at = m.end()
            name, arguments = (m["v3name"], m["v3args"]) if m["v3name"] is not None else (m["name"], m["args"])
            found = _named([{"name": name.strip(), "arguments": arguments}], "arguments")
            if found is None:
                return None
            calls += found
        return calls if calls and not body[at:].strip() else None

    def render(self, calls):
        if self.v31:
            inner = "".join(f"{CALL_BEGIN}{c['name']}{SEP}{json.dumps(c['arguments'], ensure_ascii=False)}{CALL_END}"
                            for c in calls)
        else:
            inner = "".join(f"{CALL_BEGIN}function{SEP}{c['name']}\n```json\n"
                            f"{json.dumps(c['arguments'], ensure_ascii=False)}\n```{CALL_END}" for c in calls)
        return CALLS_BEGIN + inner + CALLS_END

    def grammar(self, functions):
        import xgrammar as xgr
        one = []
        for f in functions:
            head, tail = (f"{CALL_BEGIN}{f['name']}{SEP}", CALL_END) if self.v31 else \
                (f"{CALL_BEGIN}function{SEP}{f['name']}\n```json\n", f"\n```{CALL_END}")
            one.append(xgr.Grammar.concat(_literal(head), xgr.Grammar.from_json_schema(
                _arguments_schema(f["parameters"]), any_whitespace=False, strict_mode=True), _literal(tail)))
        return xgr.Grammar.concat(_literal(CALLS_BEGIN), _union(one), _literal(CALLS_END))


class DeepSeekV31(DeepSeekV3):
    name = "deepseek_v31"
    example = f"{CALLS_BEGIN}{CALL_BEGIN}<function-name>{SEP}<arguments-json-object>{CALL_END}{CALLS_END}"
    v31 = True


QWEN_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)</function>\s*</tool_call>", re.S)
QWEN_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


class Qwen3Coder(ToolFormat):
    """Qwen3-Coder: XML-like blocks, a parameter's value as plain text (a string) or JSON (anything else)::

        <tool_call>
        <function=get_weather>
        <parameter=city>
        Paris
        </parameter>
        </function>
        </tool_call>
    """
    name = "qwen3_coder"
    markers = ("<tool_call>",)
    example = ("<tool_call>\n<function=<function-name>>\n<parameter=<name>>\n<value>\n</parameter>\n</function>\n"
               "</tool_call>")

    def read(self, text, schemas):
        calls, at = [], 0
        for m in QWEN_CALL.finditer(text):
            if text[at:m.start()].strip():
                return None
            at = m.end()
            arguments, properties = {}, schemas.get(m[1].strip(), {}).get("properties", {})
            for p in QWEN_PARAMETER.finditer(m[2]):
                key = p[1].strip()
                if (properties.get(key) or {}).get("type") == "string":
                    arguments[key] = p[2]
                    continue
                try:
                    arguments[key] = json.loads(p[2])
                except json.JSONDecodeError:   # text, as the model wrote it
                    arguments[key] = p[2]
            calls.append((m[1].strip(), json.dumps(arguments, ensure_ascii=False)))
        return calls if calls and not text[at:].strip() else None

    def render(self, calls):
        blocks = []
        for c in calls:
            params = "".join(f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}\n"
                             f"</parameter>\n" for k, v in c["arguments"].items())
            blocks.append(f"<tool_call>\n<function={c['name']}>\n{params}</function>\n</tool_call>")
        return "\n".join(blocks)

    def grammar(self, functions):
        return _union([_concat([
            _literal(f"<tool_call>\n<function={f['name']}>\n"),
            _keyword_grammar(f, self.name, lambda key, schema, f=f: _concat([
                _literal(f"<parameter={key}>\n"), _text_value(f, key, schema, self.name),
                _literal("\n</parameter>\n")])),
            _literal("</function>\n</tool_call>")]) for f in functions])


GLM_CALL = re.compile(r"<tool_call>\s*([^<\n]+?)\s*((?:<arg_key>.*?</arg_value>\s*)*)</tool_call>", re.S)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


class Glm45(ToolFormat):
    """GLM-4.5/4.6: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs, a value as
    plain text (a string) or JSON (anything else), then ``</tool_call>``."""
    name = "glm45"
    markers = ("<tool_call>",)
    example = "<tool_call><function-name>\n<arg_key><name></arg_key>\n<arg_value><value></arg_value>\n</tool_call>"

    def read(self, text, schemas):
        calls, at = [], 0
        for m in GLM_CALL.finditer(text):
            if text[at:m.start()].strip():
                return None
            at = m.end()
            arguments, properties = {}, schemas.get(m[1].strip(), {}).get("properties", {})
            for key, value in GLM_ARGUMENT.findall(m[2]):
                key = key.strip()
                if (properties.get(key) or {}).get("type") == "string":
                    arguments[key] = value
                    continue
                try:
                    arguments[key] = json.loads(value)
                except json.JSONDecodeError:   # text, as the model wrote it
                    arguments[key] = value
            calls.append((m[1].strip(), json.dumps(arguments, ensure_ascii=False)))
        return calls if calls and not text[at:].strip() else None

    def render(self, calls):
        return "\n".join(f"<tool_call>{c['name']}\n" + "".join(
            f"<arg_key>{k}</arg_key>\n<arg_value>{v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)}"
            f"</arg_value>\n" for k, v in c["arguments"].items()) + "</tool_call>" for c in calls)

    def grammar(self, functions):
        return _union([_concat([
            _literal(f"<tool_call>{f['name']}\n"),
            _keyword_grammar(f, self.name, lambda key, schema, f=f: _concat([
                _literal(f"<arg_key>{key}</arg_key>\n<arg_value>"), _text_value(f, key, schema, self.name),
                _literal("</arg_value>\n")])),
            _literal("</tool_call>")]) for f in functions])


class Pythonic(ToolFormat):
    """Llama 4 and Llama 3.2's pythonic calls: the reply is ``[get_weather(city="Paris"), f(x=1)]``, each
    argument a Python literal."""
    name = "pythonic"
    markers = ("[",)
    at_start = True
    example = "[<function-name>(<name>=<python-literal>, ...)]"

    def read(self, text, schemas):
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except SyntaxError:
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return None
            try:
                arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
            except ValueError:
                return None
            calls.append((node.func.id, json.dumps(arguments, ensure_ascii=False)))
        return calls

    def render(self, calls):
        return "[" + ", ".join(f"{c['name']}(" + ", ".join(f"{k}={v!r}" for k, v in c["arguments"].items()) + ")"
                               for c in calls) + "]"

    def grammar(self, functions):
        return _concat([_literal("["), _union([_concat([
            _literal(f"{f['name']}("),
            _keyword_grammar(f, self.name, lambda key, schema, f=f: _concat([
                _literal(f"{key}="), _python_value(f, key, schema)]), separator=", "),
            _literal(")")]) for f in functions]), _literal("]")])


# A Python string literal in double or single quotes (render writes repr's), with only the escapes \\ \" \' \n \t.
PYTHON_STRING = (r'("\"" ([^"\\\n] | "\\" ["\\nt])* "\"") | '
                 r'("\'" ([^\'\\\n] | "\\" [\'\\nt])* "\'")')


def _python_value(function: dict, key: str, schema: dict):
    """A parameter's value as a Python literal: strings, numbers, True/False, None (an object or array would be
    written with JSON's true/false/null, which Python does not read)."""
    import xgrammar as xgr
    kind = schema.get("type") if isinstance(schema, dict) else None
    choices = schema.get("enum", [schema["const"]] if "const" in schema else None) if kind else None
    if choices is not None and all(isinstance(c, (str, int, float, bool)) or c is None for c in choices):
        return _union([_literal(repr(c)) for c in choices])
    if kind == "string" and not any(k in schema for k in STRING_CHECKS):
        return xgr.Grammar.from_ebnf(f"root ::= {PYTHON_STRING}")
    if kind in ("integer", "number"):
        return xgr.Grammar.from_json_schema(_arguments_schema(schema), any_whitespace=False, strict_mode=True)
    if kind == "boolean":
        return _union([_literal("True"), _literal("False")])
    if kind == "null":
        return _literal("None")
    raise _parameter_error(function, key, "pythonic", "a Python literal, which states a string without a pattern, "
                           "format or length, a number, a boolean or null only")


HARMONY_CALL = re.compile(r"<\|channel\|>commentary to=functions\.([^<\s]+)<\|message\|>(.*?)<\|call\|>", re.S)


class Harmony(ToolFormat):
    """gpt-oss: a commentary message addressed to ``functions.NAME`` whose body is the arguments' JSON, ended by
    ``<|call|>``; read from the answer the harmony reasoning parser gives (lmport.reasoning.harmony), which
    writes each such message as ``<|channel|>commentary to=functions.NAME<|message|>ARGUMENTS<|call|>``."""
    name = "harmony"
    markers = ("<|channel|>commentary to=functions.",)
    example = "<|channel|>commentary to=functions.<function-name> <|constrain|>json<|message|><arguments-json-object>"
    spans_reasoning = True

    def read(self, text, schemas):
        calls, at = [], 0
        for m in HARMONY_CALL.finditer(text):
            if text[at:m.start()].strip():
                return None
            at = m.end()
            found = _named([{"name": m[1], "arguments": m[2]}], "arguments")
            if found is None:
                return None
            calls += found
        return calls if calls and not text[at:].strip() else None

    def render(self, calls):
        return "".join(f"<|channel|>commentary to=functions.{c['name']}<|message|>"
                       f"{json.dumps(c['arguments'], ensure_ascii=False)}<|call|>" for c in calls)

    def grammar(self, functions):
        """The whole reply after the template's ``<|start|>assistant``: an analysis message if the model thinks
        first, then the call as a commentary message to the function, its body the arguments' JSON."""
        import xgrammar as xgr
        call = _union([_concat([
            _literal(f"<|channel|>commentary to=functions.{f['name']} <|constrain|>json<|message|>"),
            xgr.Grammar.from_json_schema(_arguments_schema(f["parameters"]), any_whitespace=False, strict_mode=True),
            _literal("<|call|>")]) for f in functions])
        thinking = xgr.Grammar.from_ebnf('root ::= "<|channel|>analysis<|message|>" ([^<] | "<" [^|])* '
                                         '"<|end|><|start|>assistant"')
        return _concat([_optional(thinking), call])


FORMATS: dict[str, ToolFormat] = {f.name: f for f in (Llama3Json(), Mistral(), DeepSeekV3(), DeepSeekV31(),
                                                      Qwen3Coder(), Glm45(), Pythonic(), Harmony())}
