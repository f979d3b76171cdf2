"""Tool calling: the request's tools rendered into the prompt, `required` / named `tool_choice` constrained by a
grammar (engine/sample/grammar.py) so that the output always parses, and the output parsed into OpenAI's `tool_calls`
by a parser chosen per model family (`--tool-call-parser`).

Parsers (a registry): `hermes` — Hermes/Qwen style, each call `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`; `llama3_json` — Llama 3 style, a JSON object `{"name": ..., "parameters": {...}}` (several separated
by `;`). Each parser owns its output format three ways: the instructions of the fallback tool prompt (for chat
templates that cannot render tools, such as SmolLM2's), the grammar of a forced call, and the parsing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from specserve.engine.sample.grammar import GrammarSpec

FALLBACK_HEADER = ("You can call functions. Here are the functions you may call, as JSON Schemas of their "
                   "arguments:\n")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's tool call; `index` only in a stream's delta."""
        call = {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index} | call


class HermesParser:
    name = "hermes"
    _CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def instructions(self) -> str:
        return ("To call a function, reply with one line per call, exactly:\n<tool_call>{\"name\": FUNCTION_NAME, "
                "\"arguments\": ARGUMENTS_OBJECT}</tool_call>\nOtherwise answer normally.")

    def render_call(self, name: str, arguments: str) -> str:
        return f"<tool_call>{json.dumps({'name': name, 'arguments': json.loads(arguments or '{}')})}</tool_call>"

    def grammar(self, call_schemas: list[dict], parallel: bool) -> str:
        one = " | ".join(f"%json {json.dumps(s)}" for s in call_schemas)
        return f'start: call{"+" if parallel else ""}\ncall: "<tool_call>" body "</tool_call>"\nbody: {one}\n'

    def call_schema(self, name: str, parameters: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "arguments": parameters},
                "required": ["name", "arguments"], "additionalProperties": False}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        calls = []
        for m in self._CALL.finditer(text):
            call = _as_call(m.group(1), "arguments")
            if call is None:
                return text, []  # a malformed call: the text stays content, nothing is invented
            calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index("<tool_call>")].strip()
        return content or None, calls


class Llama3JsonParser:
    name = "llama3_json"

    def instructions(self) -> str:
        return ("To call a function, reply with only a JSON object {\"name\": FUNCTION_NAME, \"parameters\": "
                "ARGUMENTS_OBJECT} (several calls separated by ;). Otherwise answer normally.")

    def render_call(self, name: str, arguments: str) -> str:
        return json.dumps({"name": name, "parameters": json.loads(arguments or "{}")})

    def grammar(self, call_schemas: list[dict], parallel: bool) -> str:
        one = " | ".join(f"%json {json.dumps(s)}" for s in call_schemas)
        more = ' (";" call)*' if parallel else ""
        return f"start: call{more}\ncall: {one}\n"

    def call_schema(self, name: str, parameters: dict) -> dict:
        return {"type": "object", "properties": {"name": {"const": name}, "parameters": parameters},
                "required": ["name", "parameters"], "additionalProperties": False}

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        stripped = text.strip()
        if not stripped.startswith("{"):
            return text, []
        calls = [_as_call(part, "parameters") for part in _split_top_level(stripped)]
        if not calls or any(c is None for c in calls):
            return text, []
        return None, calls


PARSERS = {p.name: p for p in (HermesParser(), Llama3JsonParser())}


def _as_call(blob: str, args_key: str) -> ToolCall | None:
    try:
        obj = json.loads(blob)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(args_key, obj.get("arguments", {}))
    return ToolCall(obj["name"], json.dumps(args if args is not None else {}))


def _split_top_level(text: str) -> list[str]:
    """`{...};{...}` -> the objects (a ; inside a string or nested braces does not split)."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == ";" and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p.strip() for p in parts if p.strip()]


def template_renders_tools(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None) or ""
    return "tools" in template


def fallback_tool_prompt(tools: list[dict], parser) -> str:
    """The system text for templates without tool support: the functions and the parser's call format."""
    lines = [json.dumps({"name": t["name"], "description": t.get("description", ""),
                         "parameters": t.get("parameters") or {"type": "object", "properties": {}}})
             for t in tools]
    return FALLBACK_HEADER + "\n".join(lines) + "\n" + parser.instructions()


def _declared_only(tool: dict) -> dict:
    """The arguments' schema, limited to the declared properties unless it says otherwise: JSON Schema allows extra
    keys by default, and clients rarely say `additionalProperties` (a small model then invents arguments until it
    runs out of tokens)."""
    params = dict(tool.get("parameters") or {"type": "object", "properties": {}})
    if params.get("type") == "object" and "additionalProperties" not in params:
        params["additionalProperties"] = False
    return params


def forced_call_grammar(tools: list[dict], only: str | None, parallel: bool, parser) -> GrammarSpec:
    """`tool_choice: required` (any of the tools) or a named function: the output can only be such calls."""
    chosen = [t for t in tools if only is None or t["name"] == only]
    # compact JSON (no free whitespace): a small model can otherwise pad a forced call with whitespace forever
    schemas = [{"x-guidance": {"whitespace_flexible": False}} | parser.call_schema(t["name"], _declared_only(t))
               for t in chosen]
    return GrammarSpec("grammar", parser.grammar(schemas, parallel and only is None), "tools")


def chat_messages(req, parser, native: bool) -> tuple[list[dict], list[dict] | None]:
    """The request's messages for the chat template, and the tools to pass it (None: not passed).

    native (the template renders tools): tool results and assistant tool calls go to the template as HF expects;
    otherwise the tools become a fallback system prompt in the parser's format, assistant calls are written out in
    that format and tool results become `<tool_response>` user turns. Content is never None (SmolLM2's template
    fails on it)."""
    tools = req.tool_dicts() if req.tools_active else []
    out = []
    for m in req.messages:
        role = "system" if m.role == "developer" else m.role
        text = m.text()
        if m.role == "tool" and not native:
            out.append({"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"})
        elif m.tool_calls and native:
            out.append({"role": "assistant", "content": text, "tool_calls": [
                {"id": c.id, "type": "function",
                 "function": {"name": c.function.name, "arguments": _loads_or_text(c.function.arguments)}}
                for c in m.tool_calls]})
        elif m.tool_calls:
            calls = "\n".join(parser.render_call(c.function.name, _json_text(c.function.arguments))
                              for c in m.tool_calls)
            out.append({"role": "assistant", "content": (text + "\n" if text else "") + calls})
        elif m.role == "tool":
            out.append({"role": "tool", "content": text, "tool_call_id": m.tool_call_id})
        else:
            out.append({"role": role, "content": text})
    if not tools:
        return out, None
    if native:
        return out, [{"type": "function", "function": t} for t in tools]
    prompt = fallback_tool_prompt(tools, parser)
    if out and out[0]["role"] == "system":
        out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + prompt}
    else:
        out.insert(0, {"role": "system", "content": prompt})
    return out, None


def _loads_or_text(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _json_text(arguments: str) -> str:
    """A history's call arguments as JSON text (a client's non-JSON arguments become a JSON string)."""
    try:
        json.loads(arguments)
        return arguments
    except ValueError:
        return json.dumps(arguments)


def message_with_calls(text: str, parser, parallel: bool, delta: bool = False) -> tuple[dict, bool]:
    """A finished output -> (OpenAI's assistant message, or a stream delta's fields; whether it called tools)."""
    content, calls = parser.parse(text)
    if not calls:
        return {"role": "assistant", "content": text, "refusal": None}, False
    if not parallel:
        calls = calls[:1]
    return {"role": "assistant", "content": content, "refusal": None,
            "tool_calls": [c.to_openai(i if delta else None) for i, c in enumerate(calls)]}, True
