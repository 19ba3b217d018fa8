"""POST /tokenize and /detokenize in vLLM's shapes, and the model card (GET /v1/models[/{id}]).

/tokenize takes a `prompt` (tokenized as /v1/completions does, `add_special_tokens` default true) or
`messages` (rendered with the chat template as /v1/chat/completions does, `add_special_tokens` default
false) and returns {"count", "max_model_len", "tokens", "token_strs"}; /detokenize takes {"tokens"} and
returns {"prompt"}.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from ..tokenizer import TooManyTokens
from .protocol import APIError, ChatCompletionRequest, DetokenizeRequest, TokenizeRequest, parse_request
from .serving_chat import render_prompt, tokenize_chat
from .state import ServerState, now


def model_card(state: ServerState) -> dict[str, Any]:
    return {"id": state.config.served_model_name, "object": "model", "created": now(), "owned_by": "deltaserve",
            "root": state.config.model_path, "max_model_len": state.max_model_len}


async def tokenize(state: ServerState, http: Request) -> dict[str, Any]:
    req: TokenizeRequest = parse_request(TokenizeRequest, await http.body())
    req.check()
    state.check_model(req.model)
    tokenizer = state.need_tokenizer("prompt" if req.prompt is not None else "messages")
    if req.prompt is not None:
        state.check_prompt_chars(len(req.prompt), "prompt")
        tokens = await state.encode(req.prompt, add_special_tokens=req.add_special_tokens is not False)
    else:
        chat = req.chat_request()
        chat.check(state.limits)
        state.check_prompt_chars(chat.text_chars(), "messages")
        tokens = await state.in_pool(_chat_tokens, state, chat, bool(req.add_special_tokens))
    strs = [tokenizer.id_to_token(t) for t in tokens] if req.return_token_strs else None
    return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens, "token_strs": strs}


def _chat_tokens(state: ServerState, chat: ChatCompletionRequest, add_special_tokens: bool) -> list[int]:
    if not add_special_tokens:
        return tokenize_chat(state, chat)[1]
    prompt = render_prompt(state, chat)
    state.check_prompt_chars(len(prompt), "messages")
    try:   # as the text of the rendered prompt with the tokenizer's special tokens added
        return state.tokenizer.encode(prompt, add_special_tokens=True, max_tokens=state.max_model_len)
    except TooManyTokens as exc:
        state.check_length(exc.num_tokens, None, prompt_field="messages", max_field="max_tokens")
        raise


async def detokenize(state: ServerState, http: Request) -> dict[str, str]:
    req: DetokenizeRequest = parse_request(DetokenizeRequest, await http.body())
    state.check_model(req.model)
    tokenizer = state.need_tokenizer("tokens")
    bad = [t for t in req.tokens if not 0 <= t < tokenizer.vocab_size]
    if bad:
        raise APIError(f"tokens: token id {bad[0]} is outside the tokenizer's vocabulary [0, "
                       f"{tokenizer.vocab_size})", param="tokens")
    return {"prompt": await state.in_pool(tokenizer.decode, req.tokens, False)}
