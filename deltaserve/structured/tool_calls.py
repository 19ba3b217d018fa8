"""Forced tool calls as a grammar: `tool_choice` "required" / a named function, and `parallel_tool_calls`
false, through xgrammar's structural tag of the model's own tool-call format, so the output always parses
with server/tool_parsers.py.

The format is the one the chat template teaches: a template that writes `<function=` uses the XML style of
Qwen3-Coder / Qwen3.5 (`<tool_call>\\n<function=f>\\n<parameter=x>\\n...\\n</parameter>\\n</function>\\n</tool_call>`),
any other the hermes JSON style of Qwen3 (`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`).
Arguments follow each tool's JSON schema. Text before the first call is free (the model may write
reasoning); when the prompt leaves the model inside `<think>`, the reasoning must close first.
"""

from __future__ import annotations

from typing import Any

from ..sampling_params import StructuredOutputsParams


def tool_call_style(chat_template: str | None) -> str:
    """xgrammar's name for the template's tool-call format."""
    return "qwen_3_coder" if chat_template and "<function=" in chat_template else "qwen_3"


def tool_call_constraint(chat_template: str | None, tools: list[dict[str, Any]], tool_choice: Any,
                         parallel_tool_calls: bool, in_reasoning: bool) -> StructuredOutputsParams:
    """tools: OpenAI tool dicts; tool_choice: "required", "auto" or {"type": "function", "function":
    {"name": ...}}. "required" / named: at least one call (exactly one when not parallel); "auto" with
    parallel_tool_calls false: at most one."""
    import xgrammar as xgr

    tag = xgr.get_builtin_structural_tag(tool_call_style(chat_template), tools=tools, tool_choice=tool_choice,
                                         reasoning=False, parallel_tool_calls=parallel_tool_calls)
    spec = tag.model_dump(mode="json")
    if in_reasoning:          # the prompt opened <think>: reasoning text, its end, then the calls
        spec["format"] = {"type": "sequence", "elements": [
            {"type": "tag", "begin": "", "content": {"type": "any_text", "excludes": ["</think>"]},
             "end": "</think>"},
            spec["format"]]}
    return StructuredOutputsParams(structural_tag=spec)
