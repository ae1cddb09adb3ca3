"""A model's chat template (Jinja), rendered as llama-cpp-python's `Jinja2ChatFormatter` renders
it: the same sandbox, options, filters and globals, which follow Transformers' chat templates.

Ours because that formatter lives in `llama_cpp.llama_chat_format`, which imports the library's
whole high-level API (numpy, diskcache, ...) on the way to the first token. A test renders
every template the suite has through both and compares.
"""
from __future__ import annotations

import functools
import json
from typing import Any

# jinja2 is imported when a template is first compiled, not with this module: a load imports it
# on a helper thread while llama.cpp reads the weights (LoadedModel), ~15 ms off the first token
JINJA_MODULES = ("jinja2", "jinja2.ext", "jinja2.sandbox")


@functools.lru_cache(maxsize=1)
def _environment_parts() -> tuple[Any, Any, list[Any]]:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class IgnoreGenerationTags(jinja2.ext.Extension):
        """Pass-through for HuggingFace's `{% generation %}` chat-template tag."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            parser.stream.skip(1)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return ImmutableSandboxedEnvironment, jinja2.BaseLoader, [IgnoreGenerationTags, jinja2.ext.loopcontrols]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


def _raise_exception(message: str) -> None:
    raise ValueError(message)


class ChatTemplate:
    """`template(messages=[...], tools=[...])` is the prompt, ready for the assistant's reply."""

    def __init__(self, source: str, eos_token: str, bos_token: str) -> None:
        self.source = source
        self.eos_token = eos_token
        self.bos_token = bos_token
        environment, loader, extensions = _environment_parts()
        env = environment(loader=loader(), trim_blocks=True, lstrip_blocks=True, extensions=extensions)
        env.filters["tojson"] = _tojson
        self._template = env.from_string(source)

    def __call__(self, *, messages: list[dict[str, Any]],
                 tools: list[dict[str, Any]] | None = None, **extra: object) -> str:
        """`extra`: the template's own switches (`enable_thinking`, ...), as llama-server's
        `chat_template_kwargs`; they cannot replace the names set here."""
        fixed = dict(
            messages=messages, eos_token=self.eos_token, bos_token=self.bos_token,
            raise_exception=_raise_exception, add_generation_prompt=True, functions=None,
            function_call=None, tools=tools, tool_choice=None, strftime_now=_strftime_now)
        return str(self._template.render(**{**extra, **fixed}))
