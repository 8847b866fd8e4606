"""Chat templates (jinja2, rendered the way transformers renders them) and kvpress's split of a chat
prompt into a context part and a question part."""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Optional

# Used when a model has no chat template: the message contents, one per line, after BOS. With a single
# user turn this is bos + content + "\n", the same text kvpress builds for template-less models.
FALLBACK_TEMPLATE = "{{ bos_token }}{% for message in messages %}{{ message['content'] }}\n{% endfor %}"


def _raise_exception(message):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # jinja's own tojson escapes HTML characters; templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _generation_extension():
    """`{% generation %}...{% endgeneration %}` (marks assistant text for training masks in some
    templates): rendered as its body."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


@lru_cache(maxsize=16)
def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _generation_extension()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template)


def render_chat(template: Optional[str], messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", tools=None, documents=None, **kwargs) -> str:
    """Render `messages` ([{"role": ..., "content": ...}, ...]) with a jinja chat template, as
    transformers' apply_chat_template(tokenize=False) does; extra keyword arguments (unk_token,
    enable_thinking, ...) are passed to the template. Without a template: FALLBACK_TEMPLATE."""
    if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
        raise TypeError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
    tpl = _compile(template if template else FALLBACK_TEMPLATE)
    return tpl.render(messages=list(messages), tools=tools, documents=documents,
                      add_generation_prompt=add_generation_prompt, bos_token=bos_token or "",
                      eos_token=eos_token or "", **kwargs)


def split_context_question(template: Optional[str], context: str, bos_token: str = "", eos_token: str = "",
                           enable_thinking: bool = False, **kwargs) -> tuple[str, str]:
    """kvpress's split of a chat prompt around the context.

    With a template: render one user turn holding `context` followed by a separator that cannot occur
    in it (a run of '#' longer than the context) with the generation prompt (enable_thinking=False, as
    kvpress passes), and cut at the separator.
    Returns (context_text, question_suffix): the prompt for (context, question) is
    context_text + question + question_suffix (+ answer prefix), so the caller can prefill and
    compress context_text, then feed the rest. Without a template: (bos_token + context, "\\n")."""
    if not template:
        return (bos_token or "") + context, "\n"
    separator = "#" * (len(context) + 10)
    text = render_chat(template, [{"role": "user", "content": context + separator}], add_generation_prompt=True,
                       bos_token=bos_token, eos_token=eos_token, enable_thinking=enable_thinking, **kwargs)
    start = text.find(separator)
    if start < 0:
        raise ValueError("the chat template does not render the user message verbatim, so the prompt cannot be "
                         "split into context and question")
    # A context ending in '#' runs into the separator: the separator is the last len(separator) characters of
    # that run (kvpress cuts at the run's start instead, moving those '#' after the question).
    end = start + len(separator)
    while end < len(text) and text[end] == "#":
        end += 1
    if text.find(separator, end) >= 0:
        raise ValueError("the chat template renders the user message more than once, so the prompt cannot be "
                         "split into context and question")
    return text[:end - len(separator)], text[end:]
