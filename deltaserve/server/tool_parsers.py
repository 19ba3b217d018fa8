"""Qwen tool-call parsing: model text in, plain text and OpenAI tool-call deltas out, one chunk at a time.

Two output styles are understood, wrapped in `<tool_call>` ... `</tool_call>` or (XML style) bare:

    <tool_call>                                   <tool_call>
    {"name": "f", "arguments": {"x": 1}}          <function=f>
    </tool_call>                                  <parameter=x>
                                                  1
    (Qwen3 / Qwen3-Next, "hermes" JSON)           </parameter>
                                                  </function>
                                                  </tool_call>      (Qwen3.5 / 3.6, Qwen3-Coder XML)

`QwenToolParser` is a state machine over a text buffer. `feed(delta)` returns events in output order:
`str` for plain text, `ToolCallDelta` for a piece of a tool call. Text that could be the start of a tag
is held back until the next delta decides it, so a tag split across chunks is never leaked as text.
The first delta of a call carries its id and name; later deltas carry pieces of the arguments, whose
concatenation is the JSON text of the arguments object. JSON-style arguments stream as the model writes
them; XML-style arguments stream one parameter at a time, typed by the tool's JSON schema. A call that
cannot be parsed before anything of it was emitted comes back as plain text, so nothing is lost.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from typing import Any, Callable, Union

logger = logging.getLogger(__name__)

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
FUNCTION_START = "<function="
FUNCTION_END = "</function>"
PARAMETER_START = "<parameter="
PARAMETER_END = "</parameter>"

_JSON_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')
_MAX_NAME_CHARS = 256  # a `<function=` or `<parameter=` name longer than this is not a tag


@dataclasses.dataclass
class ToolCallDelta:
    index: int                  # which call of the message (0, 1, ...)
    id: str | None = None       # set on the first delta of a call only
    name: str | None = None     # set on the first delta of a call only
    arguments: str = ""         # the next piece of the arguments' JSON text


Event = Union[str, ToolCallDelta]


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def held_prefix_len(text: str, tags: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of one of `tags` (0 if none)."""
    best = 0
    for tag in tags:
        for k in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:k]):
                best = k
                break
    return best


def find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str | None]:
    """(position, tag) of the earliest complete tag in `text`, or (-1, None)."""
    hits = [(text.find(t), t) for t in tags]
    hits = [(i, t) for i, t in hits if i >= 0]
    return min(hits) if hits else (-1, None)


class QwenToolParser:
    def __init__(self, tools: list[dict[str, Any]] | None = None, id_factory: Callable[[], str] = new_tool_call_id):
        self._param_types = _parameter_types(tools or [])
        self._new_id = id_factory
        self._buf = ""               # unconsumed model text
        self._state = "text"
        self._raw = ""               # text consumed since the current call opened (returned if it fails)
        self._wrapped = False        # the current call sits inside <tool_call> ... </tool_call>
        self._index = 0              # index of the current / next call
        self._header_sent = False    # the current call's id + name were emitted
        # JSON style
        self._body = ""
        self._args_start = -1        # offset in _body where the arguments value starts (-1: unknown)
        self._args_sent = ""         # arguments text emitted so far for the current call
        # XML style
        self._function = ""
        self._param_name = ""
        self._num_params = 0

    @property
    def num_calls(self) -> int:
        """Calls emitted so far (complete or still streaming)."""
        return self._index + (1 if self._header_sent else 0)

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        out: list[Event] = []
        while getattr(self, f"_on_{self._state}")(out, False):
            pass
        return out

    def finish(self) -> list[Event]:
        """End of the model output: flush held-back text and close (or give back) an open call."""
        out: list[Event] = []
        while getattr(self, f"_on_{self._state}")(out, True):
            pass
        state, rest = self._state, self._buf
        self._buf = ""
        if state == "text":
            _emit_text(out, rest)
        elif state == "json":  # the final pass moved everything into the body
            self._finish_json(out, self._body)
        elif state == "after_function":
            pass
        elif state in ("call_open", "function_name") or not self._header_sent:
            _emit_text(out, self._raw + rest)
        else:  # inside an XML function whose header was sent: close what we have
            if state == "param_value":
                self._emit_param(out, rest)
            self._close_function(out)
        self._state = "text"
        return out

    # ---- helpers -----------------------------------------------------------------------------
    def _take(self, n: int) -> str:
        taken, self._buf = self._buf[:n], self._buf[n:]
        self._raw += taken
        return taken

    def _skip_space(self) -> None:
        self._take(len(self._buf) - len(self._buf.lstrip()))

    def _open_call(self, wrapped: bool, tag: str) -> None:
        self._raw, self._wrapped, self._header_sent = tag, wrapped, False
        self._body, self._args_start, self._args_sent = "", -1, ""

    def _emit_header(self, out: list[Event], name: str, arguments: str = "") -> None:
        out.append(ToolCallDelta(self._index, self._new_id(), name, arguments))
        self._header_sent, self._args_sent = True, arguments

    def _emit_args(self, out: list[Event], piece: str) -> None:
        if piece:
            out.append(ToolCallDelta(self._index, arguments=piece))
            self._args_sent += piece

    def _end_call(self) -> None:
        if self._header_sent:
            self._index += 1
        self._header_sent, self._raw = False, ""

    def _give_back(self, out: list[Event]) -> None:
        """The current call did not parse and nothing of it was emitted: return its text as plain text
        (the unconsumed rest is scanned again as text)."""
        _emit_text(out, self._raw)
        self._raw, self._state = "", "text"

    # ---- states: each returns True when it made progress and should run again ------------------
    def _on_text(self, out: list[Event], final: bool) -> bool:
        pos, tag = find_first(self._buf, (TOOL_CALL_START, FUNCTION_START))
        if tag is None:
            hold = 0 if final else held_prefix_len(self._buf, (TOOL_CALL_START, FUNCTION_START))
            _emit_text(out, self._buf[: len(self._buf) - hold])
            self._buf = self._buf[len(self._buf) - hold:]
            return False
        _emit_text(out, self._buf[:pos])
        self._buf = self._buf[pos + len(tag):]
        self._open_call(tag == TOOL_CALL_START, tag)
        self._state = "call_open" if tag == TOOL_CALL_START else "function_name"
        return True

    def _on_call_open(self, out: list[Event], final: bool) -> bool:
        self._skip_space()
        s = self._buf
        if s.startswith(FUNCTION_START):
            self._take(len(FUNCTION_START))
            self._state = "function_name"
        elif s.startswith(TOOL_CALL_END):  # an empty call: drop it
            self._take(len(TOOL_CALL_END))
            self._end_call()
            self._state = "text"
        elif not s or (not final and (FUNCTION_START.startswith(s) or TOOL_CALL_END.startswith(s))):
            return False
        else:
            self._state = "json"
        return True

    def _on_json(self, out: list[Event], final: bool) -> bool:
        pos = self._buf.find(TOOL_CALL_END)
        if pos < 0:
            keep = 0 if final else held_prefix_len(self._buf, (TOOL_CALL_END,))
            self._body += self._take(len(self._buf) - keep)
            self._stream_json(out)
            return False
        self._body += self._take(pos)
        self._take(len(TOOL_CALL_END))
        self._finish_json(out, self._body)
        return True

    def _stream_json(self, out: list[Event]) -> None:
        if not self._header_sent:
            m = _JSON_HEAD.match(self._body)
            if m is None:
                return
            self._emit_header(out, _json_string(m.group(1)))
            self._args_start = m.end()
        if self._body[self._args_start:self._args_start + 1] != "{":
            return  # arguments given as a string (or not yet visible): sent whole at the end
        safe = self._body[self._args_start:].rstrip(" \t\r\n}")
        self._emit_args(out, safe[len(self._args_sent):])

    def _finish_json(self, out: list[Event], body: str) -> None:
        self._body, self._state = body, "text"
        try:
            call = json.loads(body)
        except json.JSONDecodeError:
            call = None
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            if self._header_sent:  # can't take back what was streamed: complete the arguments if possible
                self._emit_args(out, self._raw_arguments(body)[len(self._args_sent):])
                logger.warning("tool call %d is not valid JSON; its arguments may be incomplete", self._index)
                self._end_call()
            else:
                _emit_text(out, self._raw)
                self._raw = ""
            return
        args = call.get("arguments", call.get("parameters", {}))
        text = _arguments_text(args)
        if not self._header_sent:
            self._emit_header(out, call["name"], text)
        else:
            raw = self._raw_arguments(body) if isinstance(args, dict) else text
            if not raw.startswith(self._args_sent):
                logger.warning("tool call %d: streamed arguments differ from the final ones", self._index)
                raw = self._args_sent
            self._emit_args(out, raw[len(self._args_sent):])
        self._end_call()

    def _raw_arguments(self, body: str) -> str:
        """The arguments value exactly as the model wrote it (so it extends what was streamed)."""
        try:
            _, end = json.JSONDecoder().raw_decode(body, self._args_start)
        except (json.JSONDecodeError, ValueError):
            return self._args_sent
        return body[self._args_start:end]

    def _on_function_name(self, out: list[Event], final: bool) -> bool:
        pos = self._buf.find(">")
        name_part = self._buf if pos < 0 else self._buf[:pos]
        if "\n" in name_part or len(name_part) > _MAX_NAME_CHARS:
            self._give_back(out)  # not a function tag after all
            return True
        if pos < 0:
            return False
        name = self._take(pos).strip()
        self._take(1)
        if not name:
            self._give_back(out)
            return True
        self._function, self._num_params = name, 0
        self._emit_header(out, name, "{")
        self._state = "function_body"
        return True

    def _on_function_body(self, out: list[Event], final: bool) -> bool:
        self._skip_space()
        s = self._buf
        if s.startswith(PARAMETER_START):
            self._take(len(PARAMETER_START))
            self._state = "param_name"
        elif s.startswith(FUNCTION_END):
            self._take(len(FUNCTION_END))
            self._close_function(out)
            self._state = "after_function" if self._wrapped else "text"
        elif s.startswith(TOOL_CALL_END):  # </function> missing
            self._take(len(TOOL_CALL_END))
            self._close_function(out)
            self._state = "text"
        elif not s or (not final and any(t.startswith(s) for t in (PARAMETER_START, FUNCTION_END, TOOL_CALL_END))):
            return False
        else:  # stray text between parameters: skip to the next tag
            nxt = s.find("<", 1)
            self._take(len(s) if nxt < 0 else nxt)
            return nxt >= 0
        return True

    def _on_param_name(self, out: list[Event], final: bool) -> bool:
        pos = self._buf.find(">")
        if pos < 0:
            return False
        self._param_name = self._take(pos).strip()
        self._take(1)
        self._state = "param_value"
        return True

    def _on_param_value(self, out: list[Event], final: bool) -> bool:
        pos, tag = find_first(self._buf, (PARAMETER_END, PARAMETER_START, FUNCTION_END, TOOL_CALL_END))
        if tag is None:
            return False
        value = self._take(pos)
        if tag == PARAMETER_END:  # a missing </parameter> is tolerated: the next tag ends the value
            self._take(len(tag))
        self._emit_param(out, value)
        self._state = "function_body"
        return True

    def _on_after_function(self, out: list[Event], final: bool) -> bool:
        self._skip_space()
        s = self._buf
        if s.startswith(TOOL_CALL_END):
            self._take(len(TOOL_CALL_END))
            self._state = "text"
        elif s.startswith(FUNCTION_START):  # another function in the same <tool_call>
            self._open_call(True, FUNCTION_START)
            self._take(len(FUNCTION_START))
            self._state = "function_name"
        elif not s or (not final and (TOOL_CALL_END.startswith(s) or FUNCTION_START.startswith(s))):
            return False
        else:  # </tool_call> missing: back to text
            self._state = "text"
        return True

    def _emit_param(self, out: list[Event], raw_value: str) -> None:
        if raw_value.startswith("\n"):
            raw_value = raw_value[1:]
        if raw_value.endswith("\n"):
            raw_value = raw_value[:-1]
        if not self._param_name:
            return
        value = _convert(raw_value, self._param_types.get(self._function, {}).get(self._param_name))
        sep = ", " if self._num_params else ""
        self._emit_args(out, f"{sep}{json.dumps(self._param_name, ensure_ascii=False)}: "
                             f"{json.dumps(value, ensure_ascii=False)}")
        self._num_params += 1

    def _close_function(self, out: list[Event]) -> None:
        self._emit_args(out, "}")
        self._end_call()


# ---- conversions ---------------------------------------------------------------------------------
def _emit_text(out: list[Event], text: str) -> None:
    if not text:
        return
    if out and isinstance(out[-1], str):
        out[-1] += text
    else:
        out.append(text)


def _json_string(escaped: str) -> str:
    try:
        return json.loads(f'"{escaped}"')
    except json.JSONDecodeError:
        return escaped


def _arguments_text(args: Any) -> str:
    if isinstance(args, str):  # some models JSON-encode the arguments object as a string
        try:
            json.loads(args)
            return args
        except json.JSONDecodeError:
            return json.dumps(args, ensure_ascii=False)
    return json.dumps(args, ensure_ascii=False)


def _parameter_types(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """function name -> parameter name -> JSON-schema type (str, list of str, or None)."""
    types: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = ((fn.get("parameters") or {}).get("properties") or {}) if isinstance(fn, dict) else {}
        if isinstance(fn, dict) and isinstance(fn.get("name"), str) and isinstance(props, dict):
            types[fn["name"]] = {k: (v.get("type") if isinstance(v, dict) else None) for k, v in props.items()}
    return types


def _convert(raw: str, schema_type: Any) -> Any:
    """An XML parameter's text -> its JSON value, as the tool schema types it. Strings stay strings;
    a value that does not fit its declared type is passed on as the string the model wrote."""
    kinds = schema_type if isinstance(schema_type, list) else [schema_type]
    kinds = [k for k in kinds if k not in (None, "string")] if "string" not in kinds else []
    if raw.strip().lower() in ("null", "none") and "null" in kinds:
        return None
    for kind in kinds:
        text = raw.strip()
        try:
            if kind == "integer":
                return int(text)
            if kind == "number":
                number = float(text)
                return int(number) if number.is_integer() and "." not in text and "e" not in text.lower() else number
            if kind == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            if kind in ("object", "array"):
                value = json.loads(text)
                if isinstance(value, dict if kind == "object" else list):
                    return value
        except (ValueError, json.JSONDecodeError):
            continue
    return raw
