"""The model's tokenizer, read from tokenizer.json (HF `tokenizers`) plus tokenizer_config.json /
chat_template.jinja for special tokens and the chat template."""

from __future__ import annotations

import json
import logging
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

logger = logging.getLogger(__name__)


class NoTokenizerError(ValueError):
    """A text prompt was given for a model directory without tokenizer files."""


class TooManyTokens(ValueError):
    """`encode(..., max_tokens=N)` met a text of more than N tokens; the ids were not built."""

    def __init__(self, num_tokens: int, max_tokens: int):
        super().__init__(f"the text has {num_tokens} tokens, more than {max_tokens}")
        self.num_tokens, self.max_tokens = num_tokens, max_tokens


# Escaping of special-token strings in untrusted text (see `escape_special_tokens`): ESC followed by
# chr(_ESC_BASE + k) stands for _escaped_strings()[k], to be tokenized as plain text. Private-use code points
# of plane 15, which no chat template writes.
_ESC = "\U000F0000"
_ESC_BASE = 0xF0001


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
        added = self._tok.get_added_tokens_decoder()
        self.special_ids = {i for i, t in added.items() if t.special}
        # ESC itself first, so a literal ESC in escaped text comes back as itself
        self._escaped = [_ESC] + sorted({added[i].content for i in self.special_ids}, key=len, reverse=True)
        self._escape_re = re.compile("|".join(re.escape(t) for t in self._escaped))
        self._plain: HFTokenizer | None = None        # a copy that reads special-token strings as text

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

    def encode(self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None) -> list[int]:
        """Token ids of `text`. Runs without the GIL (`encode_batch` releases it, `encode` does not), so a
        long text tokenized in a worker thread does not stall the other threads. max_tokens: raise
        TooManyTokens instead of building a longer list (for a huge text, building the Python list alone
        holds the GIL for a long time)."""
        encoding = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0]
        return self._ids(encoding, add_special_tokens, max_tokens)

    def _ids(self, encoding: Any, add_special_tokens: bool, max_tokens: int | None) -> list[int]:
        bos = add_special_tokens and self.add_bos
        if max_tokens is not None and len(encoding) + int(bos) > max_tokens:
            raise TooManyTokens(len(encoding) + int(bos), max_tokens)
        ids = encoding.ids
        if bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    # ---- special tokens in untrusted text -------------------------------------------------------
    def escape_special_tokens(self, text: str) -> str:
        """`text` with every special-token string (e.g. '<|im_start|>') replaced by a private marker, so
        that a chat template can be rendered around it and `encode_escaped` can tell the markers (text a
        client wrote) from the special tokens the template wrote itself."""
        if not self.special_ids:
            return text
        return self._escape_re.sub(lambda m: _ESC + chr(_ESC_BASE + self._escaped.index(m.group())), text)

    def unescape(self, text: str) -> str:
        """The text `escape_special_tokens` was given (markers back to the strings they replaced)."""
        return text if _ESC not in text else re.sub(
            f"{_ESC}(.)", lambda m: self._escaped[ord(m.group(1)) - _ESC_BASE], text, flags=re.DOTALL)

    def encode_escaped(self, text: str, max_tokens: int | None = None) -> list[int]:
        """Tokenize a rendered prompt whose untrusted parts went through `escape_special_tokens`: special-token
        strings in it are special tokens (the template wrote them); each marker becomes the plain-text
        tokens of the string it replaced. Without markers this is `encode(text, add_special_tokens=False)`."""
        if _ESC not in text:
            return self.encode(text, add_special_tokens=False, max_tokens=max_tokens)
        pieces = re.split(f"{_ESC}(.)", text, flags=re.DOTALL)
        special, plain = pieces[0::2], [self._escaped[ord(c) - _ESC_BASE] for c in pieces[1::2]]
        if self._plain is None:
            self._plain = HFTokenizer.from_str(self._tok.to_str())
            self._plain.encode_special_tokens = True
        special_enc = self._tok.encode_batch(special, add_special_tokens=False)
        plain_enc = self._plain.encode_batch(plain, add_special_tokens=False)
        total = sum(len(e) for e in special_enc) + sum(len(e) for e in plain_enc)
        if max_tokens is not None and total > max_tokens:
            raise TooManyTokens(total, max_tokens)
        ids: list[int] = []
        for i, enc in enumerate(special_enc):
            ids += enc.ids
            if i < len(plain_enc):
                ids += plain_enc[i].ids
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
