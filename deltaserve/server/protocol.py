"""OpenAI request schemas, validated strictly: an unknown field, a wrong type or a value we cannot honour
is an `APIError` (HTTP 400) naming the field. Standard OpenAI fields that deltaserve does not implement
are accepted only with values that make them no-ops (`user`, an empty `logit_bias`, ...).

`to_sampling_params` maps the OpenAI names (and vLLM's extras) onto `SamplingParams`, whose own
validation errors become 400s too.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..sampling_params import SamplingParams, StructuredOutputsParams

_INT64 = dict(ge=-(2**63), le=2**63 - 1)


class APIError(Exception):
    """An error answered with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.type, self.code = message, status, param, type, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    """The server's caps on one request (flags of `deltaserve serve`); vocab_size None: not checked."""

    max_logprobs: int = 20
    max_n: int = 128                  # OpenAI's cap on n
    max_stop_sequences: int = 64
    max_tools: int = 128              # OpenAI's cap on tools
    vocab_size: int | None = None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_Strict):
    """Fields shared by both endpoints: OpenAI's sampling fields and vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: Union[str, list[str], None] = None
    seed: int | None = Field(default=None, **_INT64)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None                       # accepted, not used
    # accepted, not used (they change nothing in generation; README: "accepted and ignored")
    metadata: dict[str, str] | None = None
    store: bool | None = None                     # nothing is stored either way
    service_tier: str | None = None
    prediction: dict[str, Any] | None = None      # only null: predicted outputs are not implemented
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    prompt_logprobs: int | None = None            # top-n logprobs of every prompt token (the first: null)
    priority: int = Field(default=0, **_INT64)    # lower first; needs --scheduling-policy priority
    # ---- structured output and logit control (checked in _check_structured) ----
    logit_bias: dict[str, float] | None = None    # OpenAI: token id (as a string) -> bias in [-100, 100]
    bad_words: list[str] | None = None            # vLLM: words never to generate
    structured_outputs: StructuredOutputsRequest | None = None   # vLLM's structured_outputs
    guided_json: Union[dict[str, Any], str, None] = None          # vLLM's older names for the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def check_common(self, limits: RequestLimits) -> None:
        if not 1 <= self.n <= limits.max_n:
            raise APIError(f"n must be in [1, {limits.max_n}], got {self.n}", param="n")
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        if len(stops) > limits.max_stop_sequences:
            raise APIError(f"stop has {len(stops)} sequences; at most {limits.max_stop_sequences} are accepted",
                           param="stop")
        if self.stop_token_ids and limits.vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < limits.vocab_size]
            if bad:
                raise APIError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary [0, "
                               f"{limits.vocab_size})", param="stop_token_ids")
        self._check_logit_bias(limits)
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            raise APIError("bad_words must be non-blank strings", param="bad_words")
        if self.stream_options is not None and not self.stream:
            raise APIError("stream_options is only allowed with stream=true", param="stream_options")
        if self.prediction is not None:
            raise APIError("prediction (predicted outputs) is not supported", param="prediction")
        if self.prompt_logprobs is not None:
            if not 0 <= self.prompt_logprobs <= limits.max_logprobs:
                raise APIError(f"prompt_logprobs must be in [0, {limits.max_logprobs}], got {self.prompt_logprobs}",
                               param="prompt_logprobs")
            if self.stream:
                raise APIError("prompt_logprobs is not supported with stream=true", param="prompt_logprobs")

    def _check_logit_bias(self, limits: RequestLimits) -> None:
        for key, bias in (self.logit_bias or {}).items():
            if not re.fullmatch(r"\d+", key):
                raise APIError(f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
            if limits.vocab_size is not None and int(key) >= limits.vocab_size:
                raise APIError(f"logit_bias: token id {key} is outside the vocabulary [0, {limits.vocab_size})",
                               param="logit_bias")
            if not -100 <= bias <= 100:
                raise APIError(f"logit_bias values must be in [-100, 100], got {bias} for token {key}",
                               param="logit_bias")

    def structured_sources(self) -> dict[str, StructuredOutputsParams]:
        """Each field given that constrains the output, as StructuredOutputsParams (APIError naming a bad one)."""
        found: dict[str, StructuredOutputsParams] = {}
        if self.structured_outputs is not None:
            found["structured_outputs"] = _structured(self.structured_outputs.model_dump(exclude_none=True, by_alias=True),
                                                      "structured_outputs")
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, field) is not None:
                found[field] = _structured({key: getattr(self, field)}, field)
        return found

    def structured_output(self) -> StructuredOutputsParams | None:
        """The output constraint (at most one field may give one)."""
        found = self.structured_sources()
        if len(found) > 1:
            raise APIError(f"give one output constraint, not {' and '.join(found)}", param=list(found)[1])
        return next(iter(found.values()), None)

    def sampling_kwargs(self) -> dict[str, Any]:
        kwargs = dict(n=self.n, stop=self.stop, seed=self.seed, presence_penalty=self.presence_penalty,
                      frequency_penalty=self.frequency_penalty, ignore_eos=self.ignore_eos,
                      min_tokens=self.min_tokens, stop_token_ids=self.stop_token_ids,
                      include_stop_str_in_output=self.include_stop_str_in_output,
                      skip_special_tokens=self.skip_special_tokens, prompt_logprobs=self.prompt_logprobs,
                      logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
                      bad_words=self.bad_words or None, structured_outputs=self.structured_output())
        optional = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                        repetition_penalty=self.repetition_penalty)
        kwargs.update({k: v for k, v in optional.items() if v is not None})
        return kwargs


class StructuredOutputsRequest(_Strict):
    """vLLM's `structured_outputs` object: exactly one constraint (see SamplingParams' StructuredOutputsParams)."""

    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Union[dict[str, Any], str, None] = None
    disable_any_whitespace: bool = False


def _structured(fields: dict[str, Any], param: str) -> StructuredOutputsParams:
    try:
        return StructuredOutputsParams(**fields)
    except ValueError as exc:
        raise APIError(str(exc).replace("SamplingParams.structured_outputs", param, 1), param=param) from None


_SamplingFields.model_rebuild()


class CompletionRequest(_SamplingFields):
    # left to right, token ids before strings: pydantic's default ("smart") union validates a long token-id
    # list against list[str] in full first (one error per id: seconds of event-loop time for a big prompt)
    prompt: Union[str, list[int], list[str], list[list[int]]] = Field(union_mode="left_to_right")
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None                    # sample best_of, return the n with the highest cumulative logprob
    suffix: str | None = None                     # not supported (no fill-in-the-middle)
    # vLLM extra: keep only the prompt's last k tokens (-1: max_model_len)
    truncate_prompt_tokens: int | None = Field(default=None, **_INT64)

    @property
    def num_candidates(self) -> int:
        return self.best_of if self.best_of is not None else self.n

    def check(self, limits: RequestLimits) -> None:
        max_logprobs = limits.max_logprobs
        if self.best_of is not None and not 1 <= self.best_of <= limits.max_n:
            raise APIError(f"best_of must be in [1, {limits.max_n}], got {self.best_of}", param="best_of")
        self.check_common(limits)
        if self.suffix is not None:
            raise APIError("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of < self.n:
            raise APIError(f"best_of ({self.best_of}) must be >= n ({self.n})", param="best_of")
        if self.num_candidates > self.n and self.stream:
            raise APIError("best_of > n is not supported with stream=true", param="best_of")
        if self.num_candidates > self.n and self.temperature == 0:
            raise APIError("best_of > n needs sampling (temperature > 0): greedy candidates are identical",
                           param="best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= max_logprobs:
            raise APIError(f"logprobs must be in [0, {max_logprobs}], got {self.logprobs}", param="logprobs")
        if self.max_tokens is not None and self.max_tokens < 0:
            raise APIError(f"max_tokens must be >= 0, got {self.max_tokens}", param="max_tokens")
        if self.max_tokens == 0 and not self.echo and self.prompt_logprobs is None:
            raise APIError("max_tokens=0 generates nothing: it needs echo=true or prompt_logprobs (scoring the "
                           "prompt)", param="max_tokens")
        if (self.echo and self.logprobs is not None and self.prompt_logprobs is not None
                and self.prompt_logprobs != self.logprobs):
            raise APIError(f"with echo=true and logprobs={self.logprobs} the prompt's logprobs are the echoed "
                           f"ones: prompt_logprobs must equal logprobs or be omitted", param="prompt_logprobs")
        k = self.truncate_prompt_tokens
        if k is not None and k < 1 and k != -1:
            raise APIError(f"truncate_prompt_tokens must be >= 1 or -1 (max_model_len), got {k}",
                           param="truncate_prompt_tokens")
        if isinstance(self.prompt, list) and not self.prompt:
            raise APIError("prompt must not be empty", param="prompt")


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None


# the Qwen templates have one thinking switch: no effort level but "none" / "minimal" turns it off
REASONING_EFFORT_THINKING = {"none": False, "minimal": False, "low": True, "medium": True, "high": True}


class JsonSchemaFormat(_Strict):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def constraint(self) -> StructuredOutputsParams | None:
        """OpenAI's response_format as a grammar: json_object any object, json_schema its schema (strict or
        not, the output follows the schema: the grammar cannot do less)."""
        if self.type == "text":
            if self.json_schema is not None:
                raise APIError("response_format.json_schema needs type 'json_schema'", param="response_format")
            return None
        if self.type == "json_object":
            if self.json_schema is not None:
                raise APIError("response_format.json_schema needs type 'json_schema'", param="response_format")
            return StructuredOutputsParams(json_object=True)
        if self.json_schema is None:
            raise APIError("response_format type 'json_schema' needs json_schema", param="response_format.json_schema")
        schema = self.json_schema.schema_ if self.json_schema.schema_ is not None else {}   # OpenAI: any JSON
        return _structured({"json": schema}, "response_format.json_schema")


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], NamedToolChoice, None] = None
    parallel_tool_calls: bool | None = None       # only true: calls are not limited to one
    response_format: ResponseFormat | None = None  # only {"type": "text"}
    # vLLM / transformers chat-template extras
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # OpenAI's thinking control, mapped onto the template's enable_thinking (REASONING_EFFORT_THINKING)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def template_kwargs(self) -> dict[str, Any]:
        """chat_template_kwargs, with `enable_thinking` from reasoning_effort when that is given."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            thinking = REASONING_EFFORT_THINKING[self.reasoning_effort]
            if kwargs.get("enable_thinking", thinking) != thinking:
                raise APIError(f"reasoning_effort={self.reasoning_effort!r} contradicts "
                               f"chat_template_kwargs.enable_thinking={kwargs['enable_thinking']!r}",
                               param="reasoning_effort")
            kwargs["enable_thinking"] = thinking
        return kwargs

    def check(self, limits: RequestLimits) -> None:
        max_logprobs = limits.max_logprobs
        self.check_common(limits)
        if self.tools is not None and len(self.tools) > limits.max_tools:
            raise APIError(f"tools has {len(self.tools)} entries; at most {limits.max_tools} are accepted",
                           param="tools")
        if not self.messages:
            raise APIError("messages must not be empty", param="messages")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise APIError("give max_tokens or max_completion_tokens, not both", param="max_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise APIError("top_logprobs needs logprobs=true", param="top_logprobs")
            if not 0 <= self.top_logprobs <= max_logprobs:
                raise APIError(f"top_logprobs must be in [0, {max_logprobs}], got {self.top_logprobs}",
                               param="top_logprobs")
        self._check_tools()
        if self.continue_final_message and self.add_generation_prompt:
            raise APIError("continue_final_message needs add_generation_prompt=false", param="continue_final_message")
        if self.continue_final_message and self.messages[-1].role != "assistant":
            raise APIError("continue_final_message needs a final assistant message", param="continue_final_message")
        reserved = {"messages", "tools", "add_generation_prompt"} & set(self.chat_template_kwargs or {})
        if reserved:
            raise APIError(f"chat_template_kwargs must not set {sorted(reserved)}", param="chat_template_kwargs")
        self.template_kwargs()   # a reasoning_effort contradicting enable_thinking is refused here

    def _check_tools(self) -> None:
        choice = self.tool_choice
        if choice in ("auto", "required") and not self.tools:
            raise APIError(f"tool_choice={choice!r} needs tools", param="tool_choice")
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise APIError("tools contain duplicate function names", param="tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise APIError(f"tool_choice names {choice.function.name!r}, which is not in tools",
                           param="tool_choice.function.name")
        if self.tool_call_grammar:
            field = "tool_choice" if self.forces_tool_call else "parallel_tool_calls"
            if self.structured_sources() | self._format_source():
                raise APIError(f"{field} constrains the output to tool calls; it cannot be combined with another "
                               "output constraint", param=field)
            if self.min_tokens:
                raise APIError(f"min_tokens cannot be combined with {field} (a completed call allows only the end "
                               "of the message)", param="min_tokens")

    @property
    def forces_tool_call(self) -> bool:
        return isinstance(self.tool_choice, NamedToolChoice) or self.tool_choice == "required"

    @property
    def tool_call_grammar(self) -> bool:
        """The output is constrained to tool calls: a forced call, or at most one (parallel_tool_calls false)."""
        return self.uses_tools and (self.forces_tool_call or self.parallel_tool_calls is False)

    @property
    def forced_tools(self) -> list[Tool]:
        """The tools a forced call may use: the named one, or all of them for 'required'."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return [t for t in self.tools or [] if t.function.name == self.tool_choice.function.name]
        return list(self.tools or []) if self.tool_choice == "required" else []

    def _format_source(self) -> dict[str, StructuredOutputsParams]:
        c = self.response_format.constraint() if self.response_format is not None else None
        return {"response_format": c} if c is not None else {}

    def structured_output(self) -> StructuredOutputsParams | None:
        found = self.structured_sources() | self._format_source()
        if len(found) > 1:
            raise APIError(f"give one output constraint, not {' and '.join(found)}", param=list(found)[1])
        return next(iter(found.values()), None)

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    @property
    def max_output_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def text_chars(self) -> int:
        """Characters of text in the messages (content, reasoning, tool-call arguments): the prompt-size
        check made before the template is rendered."""
        total = 0
        for m in self.messages:
            total += len(_text_content(m.content)) + len(m.reasoning_content or "")
            total += sum(len(c.function.arguments) for c in m.tool_calls or [])
        return total

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as chat templates expect them: text parts joined, tool-call arguments as dicts."""
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": m.role, "content": _text_content(m.content)}
            for key in ("name", "tool_call_id", "reasoning_content"):
                if getattr(m, key) is not None:
                    msg[key] = getattr(m, key)
            if m.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function",
                     "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, i, j)}}
                    for j, c in enumerate(m.tool_calls)]
            out.append(msg)
        return out


def _text_content(content: str | list[TextPart] | None) -> str:
    if content is None:
        return ""
    return content if isinstance(content, str) else "\n".join(p.text for p in content)


def _arguments(text: str, i: int, j: int) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, dict):
        raise APIError(f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object",
                       param=f"messages.{i}.tool_calls.{j}.function.arguments")
    return value


# ---- /tokenize and /detokenize (vLLM's shapes) --------------------------------------------------
class TokenizeRequest(_Strict):
    """Either `prompt` (add_special_tokens default true) or `messages` (chat template; default false)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    return_token_strs: bool = False
    # with messages only
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise APIError("give exactly one of prompt or messages", param="prompt")
        if self.prompt is not None:
            chat_only = [f for f in ("add_generation_prompt", "chat_template_kwargs", "tools", "reasoning_effort")
                         if getattr(self, f) is not None] + (["continue_final_message"] if self.continue_final_message
                                                             else [])
            if chat_only:
                raise APIError(f"{chat_only[0]} needs messages, not prompt", param=chat_only[0])

    def chat_request(self) -> ChatCompletionRequest:
        fields = dict(messages=self.messages, tools=self.tools, chat_template_kwargs=self.chat_template_kwargs,
                      continue_final_message=self.continue_final_message, reasoning_effort=self.reasoning_effort,
                      tool_choice="auto" if self.tools else None,
                      add_generation_prompt=(not self.continue_final_message if self.add_generation_prompt is None
                                             else self.add_generation_prompt))
        return ChatCompletionRequest(**fields)


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


# ---- parsing and mapping ------------------------------------------------------------------------
def parse_request(model_cls: type[_Strict], body: bytes) -> Any:
    """Validate a raw JSON body; every problem becomes an APIError naming the field."""
    try:
        return model_cls.model_validate_json(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0]
    if first["type"] == "json_invalid":
        return APIError(f"request body is not valid JSON: {first['msg']}")
    if first["type"] == "model_type" and not first["loc"]:
        return APIError("request body must be a JSON object")
    field, tag = _field_path(first["loc"])
    if first["type"] == "missing":
        return APIError(f"'{field}' is required", param=field)
    if first["type"] == "extra_forbidden":
        return APIError(f"'{field}' is not a supported field", param=field)
    if tag is None:
        return APIError(f"invalid value for '{field}': {first['msg']}", param=field)
    forms: dict[str, str] = {}  # a union: say why each accepted form did not fit
    for e in errors:
        f, t = _field_path(e["loc"])
        if f == field and t is not None:
            forms.setdefault(t, e["msg"])
    detail = "; ".join(f"as {t}: {msg}" for t, msg in forms.items())
    return APIError(f"invalid value for '{field}': {detail}", param=field)


def _field_path(loc: tuple) -> tuple[str, str | None]:
    """('messages', 0, 'content', 'list[TextPart]', 0, 'type') -> ('messages.0.content', 'list[TextPart]'):
    the path up to the first union-member tag pydantic puts in `loc`, and that tag."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, str) and _is_union_tag(p):
            return ".".join(parts), p
        parts.append(str(p))
    return ".".join(parts), None


def _is_union_tag(part: str) -> bool:
    """Type names such as 'str', 'list[int]', 'NamedToolChoice'; field names are lower_snake_case."""
    return "[" in part or part in ("str", "int", "float", "bool") or part[:1].isupper()


def to_sampling_params(request: CompletionRequest | ChatCompletionRequest, **extra: Any) -> SamplingParams:
    kwargs = request.sampling_kwargs()
    kwargs.update(extra)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        message = str(exc)
        m = re.match(r"SamplingParams\.(\w+):", message)
        raise APIError(message.replace("SamplingParams.", "", 1), param=m.group(1) if m else None) from None
