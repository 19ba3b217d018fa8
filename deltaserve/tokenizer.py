"""The model's tokenizer, read from tokenizer.json (HF `tokenizers`) plus tokenizer_config.json /
chat_template.jinja for special tokens and the chat template."""

from __future__ import annotations

import json
import logging
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)


class NoTokenizerError(ValueError):
    """A text prompt was given for a model directory without tokenizer files."""


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        self.path = path
        self._tok = HFTokenizer.from_file(str(path / "tokenizer.json"))
        cfg_file = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        template_file = path / "chat_template.jinja"
        self.chat_template: str | None = (
            template_file.read_text() if template_file.is_file() else self.config.get("chat_template"))
        if isinstance(self.chat_template, list):  # [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.eos_token = _token_content(self.config.get("eos_token"))
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.pad_token = _token_content(self.config.get("pad_token"))
        self.eos_token_id = self.token_to_id(self.eos_token)
        self.bos_token_id = self.token_to_id(self.bos_token)
        self.add_bos = bool(self.config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.special_ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special} \
            if hasattr(self._tok, "get_added_tokens_decoder") else set()

    @classmethod
    def from_dir(cls, path: str | Path) -> "Tokenizer | None":
        """The tokenizer of a model directory, or None when it has no tokenizer.json."""
        if not (Path(path) / "tokenizer.json").is_file():
            logger.warning("no tokenizer.json in %s: only token-id prompts will work", path)
            return None
        return cls(path)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decode_stream(self, context_ids: list[int], skip_special_tokens: bool = True) -> Callable[[int], str | None]:
        """Incremental decoding with tokenizers' DecodeStream: feed generated tokens one at a time, get the
        text each completes (None while a character or merge is still incomplete). `context_ids` (the end
        of the prompt) make the first tokens render as they would after them (leading spaces, merges)."""
        stream = DecodeStream(ids=list(context_ids), skip_special_tokens=skip_special_tokens)
        return lambda token_id: stream.step(self._tok, token_id)

    def apply_chat_template(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None, **kwargs: Any) -> str:
        """Render the chat template with jinja2 the way transformers does (same globals and filters)."""
        if not self.chat_template:
            raise ValueError(f"the tokenizer in {self.path} has no chat template")
        return _compiled_template(self.chat_template).render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


def _raise(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _compiled_template(source: str):
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, separators=None, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat template does not parse: {exc}") from exc
