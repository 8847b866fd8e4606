"""Chat templates (jinja2, rendered as transformers does) and kvpress's context / question split."""
from __future__ import annotations

from datetime import datetime
from typing import Optional

_FALLBACK = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"


def _environment():
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        from jinja2.exceptions import TemplateError
        raise TemplateError(message)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: __import__("json").dumps(
        x, indent=indent, ensure_ascii=ensure_ascii)
    return env


def render_chat(template: Optional[str], messages: list[dict], add_generation_prompt: bool = True,
                bos_token: str = "", eos_token: str = "", **kwargs) -> str:
    """Render `messages` with a chat template (a plain one, content per line, when there is none)."""
    tpl = _environment().from_string(template or _FALLBACK)
    return tpl.render(messages=messages, add_generation_prompt=add_generation_prompt, bos_token=bos_token,
                      eos_token=eos_token, **kwargs)


def split_context_question(template: Optional[str], context: str, bos_token: str = "", eos_token: str = "") -> tuple[str, str]:
    """kvpress's split of a chat prompt: render the user turn `context + separator` with the generation
    prompt, and cut at the separator. Returns (context part, suffix that follows the question).
    Without a template: (bos + context, "\\n")."""
    if not template:
        return bos_token + context, "\n"
    separator = "#" * (len(context) + 10)
    text = render_chat(template, [{"role": "user", "content": context + separator}], add_generation_prompt=True,
                       bos_token=bos_token, eos_token=eos_token)
    before, _, after = text.partition(separator)
    return before, after
