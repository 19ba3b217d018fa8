"""Engine logprobs -> the two OpenAI shapes (completions' parallel lists, chat's list of objects)."""

from __future__ import annotations

from typing import Any

from ..outputs import PositionLogprobs


class TokenText:
    """Token id -> the text OpenAI shows for it in logprobs (special tokens included), cached."""

    def __init__(self, tokenizer: Any):
        self._tokenizer = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = (f"token_id:{token_id}" if self._tokenizer is None
                    else self._tokenizer.decode([token_id], skip_special_tokens=False))
            self._cache[token_id] = text
        return text


def _ranked(position: PositionLogprobs) -> list[tuple[int, float]]:
    return sorted(((t, lp.logprob) for t, lp in position.items()), key=lambda item: -item[1])


def completion_logprobs(token_ids: list[int], positions: list[PositionLogprobs | None], text: TokenText,
                        offset: int = 0) -> dict[str, list]:
    """{tokens, token_logprobs, top_logprobs, text_offset}; a position without logprobs (the first prompt
    token) gives None. top_logprobs holds the requested top-n plus the chosen token."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token_id, position in zip(token_ids, positions):
        token = text(token_id)
        out["tokens"].append(token)
        out["text_offset"].append(offset)
        offset += len(token)
        if position is None:
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            continue
        chosen = position.get(token_id)
        out["token_logprobs"].append(None if chosen is None else chosen.logprob)
        top: dict[str, float] = {}
        for t, lp in _ranked(position):
            top.setdefault(text(t), lp)  # distinct ids can share a text (byte pieces): keep the likeliest
        out["top_logprobs"].append(top)
    return out


def chat_logprobs(token_ids: list[int], positions: list[PositionLogprobs], text: TokenText,
                  top_n: int) -> list[dict[str, Any]]:
    """[{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] * top_n}] per generated token."""
    content = []
    for token_id, position in zip(token_ids, positions):
        token = text(token_id)
        chosen = position.get(token_id)
        content.append({
            "token": token, "logprob": None if chosen is None else chosen.logprob,
            "bytes": list(token.encode("utf-8")),
            "top_logprobs": [{"token": text(t), "logprob": lp, "bytes": list(text(t).encode("utf-8"))}
                             for t, lp in _ranked(position)[:top_n]],
        })
    return content
