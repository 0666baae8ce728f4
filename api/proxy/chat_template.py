"""A model's chat template, rendered here as vLLM renders it, so routing sees the engine's tokens.

Hugging Face's conventions (what vLLM calls through ``transformers``): a Jinja2 sandbox (immutable,
``trim_blocks``, ``lstrip_blocks``, loop controls, the ``{% generation %}`` tag), ``tojson`` without
HTML escaping, ``raise_exception`` and ``strftime_now``; the template gets ``messages``, ``tools``,
``documents``, ``add_generation_prompt``, the tokenizer's named special tokens (``bos_token``,
``eos_token``, ...) and the request's ``chat_template_kwargs``. vLLM's preparation of the request is
followed too: a system message loses a first line of Claude Code's billing header; a message keeps
``role``, ``content`` (none: ``""``), ``name``, an assistant's ``tool_calls`` (``id``, ``function``
with ``arguments`` parsed from JSON into an object, then ``name``, and ``type``) and ``reasoning``, a
tool's ``tool_call_id``; a tool keeps ``type`` and its function's ``name``, ``description``,
``parameters`` (``null`` when absent) and ``strict``.

What is not rendered here raises `NotLocal`, and the engine's ``/tokenize`` answers instead: content
given as a list of parts, templates that iterate over a message's content (vLLM hands them parts),
a ``developer`` message the template does not know, ``continue_final_message``, a request's own
``chat_template``, and ``chat_template_kwargs`` naming one of the arguments above.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
import msgspec

from api.proxy.wire import ChatBody, ChatMessage

__all__ = ["ChatTemplate", "NotLocal", "without_billing_header"]

# The request's chat_template_kwargs may not name what the proxy sets itself.
_RESERVED_KWARGS = frozenset(
    {"messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
     "chat_template", "tokenize", "return_dict"}
)  # fmt: skip


# Claude Code's first system line (its value changes per request), which vLLM strips.
_BILLING_HEADER = "x-anthropic-billing-header"


class NotLocal(Exception):
    """The request needs the engine's own rendering."""


class _Generation(jinja2.ext.Extension):
    """Hugging Face's ``{% generation %}...{% endgeneration %}``: marks assistant text, renders as is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2 declares it so)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None,
    separators: tuple[str, str] | None = None, sort_keys: bool = False,
) -> str:  # fmt: skip
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _iterates_over_content(ast: jinja2.nodes.Template) -> bool:
    """Whether a ``for`` loop walks a ``content`` (``message.content``, ``message['content']``, a
    variable ``content``): vLLM then hands the template content as a list of parts, not a string."""
    for loop in ast.find_all(jinja2.nodes.For):
        for node in (loop.iter, *loop.iter.find_all(jinja2.nodes.Node)):
            key = node.arg if isinstance(node, jinja2.nodes.Getitem) else None
            named = (
                (isinstance(node, jinja2.nodes.Name) and node.name)
                or (isinstance(node, jinja2.nodes.Getattr) and node.attr)
                or (isinstance(key, jinja2.nodes.Const) and key.value)
            )
            if named == "content":
                return True
    return False


class ChatTemplate:
    """One model's template(s), compiled once; `render` gives the text vLLM would tokenize."""

    def __init__(self, templates: dict[str, str], special_tokens: dict[str, str]) -> None:
        """``templates``: by name, ``default`` (and ``tool_use``, picked when a request has tools).
        Raises ``jinja2.TemplateSyntaxError`` for a template that does not compile."""
        env = _environment()
        self._compiled = {name: env.from_string(source) for name, source in templates.items()}
        self._strings_only = {name: not _iterates_over_content(env.parse(s)) for name, s in templates.items()}
        self._knows_developer = {name: "'developer'" in s or '"developer"' in s for name, s in templates.items()}
        self._special_tokens = special_tokens

    def render(self, request: ChatBody) -> str:
        """The prompt text; raises `NotLocal`, or ``jinja2.TemplateError`` (the template refused the
        conversation, or failed on it, as the engine would: a 400)."""
        tools = _tools(request.tools) if request.tools is not None else None
        name = "tool_use" if tools is not None and "tool_use" in self._compiled else "default"
        template = self._compiled.get(name)
        if template is None:
            raise NotLocal("no default chat template")
        if not self._strings_only[name]:
            raise NotLocal("the template iterates over message content")
        if request.chat_template is not None or request.continue_final_message:
            raise NotLocal("chat_template or continue_final_message")
        extra = request.chat_template_kwargs or {}
        if _RESERVED_KWARGS.intersection(extra):
            raise NotLocal("chat_template_kwargs names a reserved argument")
        messages = [_message(message) for message in request.messages]
        if not self._knows_developer[name] and any(m["role"] == "developer" for m in messages):
            raise NotLocal("a developer message for a template without that role")
        try:
            return template.render(
                {
                    **self._special_tokens,
                    **extra,
                    "messages": messages,
                    "tools": tools,
                    "documents": None,
                    "add_generation_prompt": request.add_generation_prompt,
                }
            )
        except (TypeError, ValueError, RuntimeError) as exc:
            # The template failing on these arguments (a number in chat_template_kwargs added to a text):
            # vLLM answers these as it answers raise_exception, a 400.
            raise jinja2.TemplateError(str(exc)) from exc


def without_billing_header(message: ChatMessage) -> ChatMessage:
    """The message without a system message's first line of Claude Code's billing header: it changes on
    every request, and vLLM drops it."""
    content = message.content
    if message.role == "system" and isinstance(content, str) and content.startswith(_BILLING_HEADER):
        return msgspec.structs.replace(message, content=content.partition("\n")[2])
    return message


def _message(message: ChatMessage) -> dict[str, Any]:
    message = without_billing_header(message)
    content = message.content
    if isinstance(content, list):
        raise NotLocal("content given as parts")
    prepared: dict[str, Any] = {"role": message.role, "content": content or ""}
    if message.role == "assistant":
        if message.tool_calls:  # vLLM drops an empty list
            prepared["tool_calls"] = [_tool_call(call) for call in message.tool_calls]
        if message.reasoning is not None:
            prepared["reasoning"] = prepared["reasoning_content"] = message.reasoning
    elif message.role == "tool" and message.tool_call_id is not None:
        prepared["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        prepared["name"] = message.name
    return prepared


def _tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An assistant's tool call as vLLM rebuilds it (OpenAI's fields in their declared order, others
    dropped), its ``arguments`` an object as templates expect (a string that is not a JSON object: ``{}``)."""
    function = call.get("function")
    if call.get("type") != "function" or not isinstance(call.get("id"), str) or not isinstance(function, dict):
        raise NotLocal("a tool call that is not a function call")
    arguments, name = function.get("arguments"), function.get("name")
    if not isinstance(arguments, str) or not isinstance(name, str):
        raise NotLocal("a function call without a name or arguments")
    try:
        parsed = json.loads(arguments) if arguments else {}
    except json.JSONDecodeError:
        parsed = {}
    return {"id": call["id"], "function": {"arguments": parsed if isinstance(parsed, dict) else {}, "name": name},
            "type": "function"}  # fmt: skip


def _tools(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The tools as vLLM hands them to the template: its own fields only, absent ones ``None`` but for
    the optional flags."""
    prepared = []
    for tool in tools:
        function = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise NotLocal("a tool that is not a function")
        if not isinstance(function.get("name"), str):
            raise NotLocal("a tool without a name")
        described: dict[str, Any] = {
            "name": function["name"],
            "description": function.get("description"),
            "parameters": function.get("parameters"),
        }
        for flag in ("strict", "defer_loading"):
            if function.get(flag) is not None:
                described[flag] = function[flag]
            elif flag == "defer_loading" and tool.get(flag) is not None:
                described[flag] = tool[flag]
        entry: dict[str, Any] = {"type": "function", "function": described}
        if tool.get("defer_loading") is not None:
            entry["defer_loading"] = tool["defer_loading"]
        prepared.append(entry)
    return prepared
