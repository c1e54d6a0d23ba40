"""The model's tokenizer: `tokenizer.json` through the `tokenizers` library, plus its chat template."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from engine.chat_template import ChatTemplateError, render_chat_template
from engine.errors import ModelLoadError
from engine.model_files import fingerprint_text, read_json, read_optional_json, require_file

Message = Mapping[str, Any]


class Tokenizer:
    """Encode, decode and apply the chat template exactly as the model expects."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        chat_template: str | None = None,
        extra_eos_token_ids: Sequence[int] = (),
        add_bos_token: bool | None = None,
        fingerprint: str = "",
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.chat_template = chat_template
        self.bos_token_id = backend.token_to_id(bos_token) if bos_token else None
        eos_id = backend.token_to_id(eos_token) if eos_token else None
        eos_ids = ([eos_id] if eos_id is not None else []) + list(extra_eos_token_ids)
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_ids))
        self._add_bos_token = add_bos_token
        self.fingerprint = fingerprint or fingerprint_text(backend.to_str())
        self.template_fingerprint = fingerprint_text(chat_template or "")
        self._byte_level = isinstance(backend.decoder, tokenizers.decoders.ByteLevel)
        self._special = {t.content for t in backend.get_added_tokens_decoder().values()}

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, extra_eos_token_ids: Sequence[int] = ()
    ) -> Tokenizer:
        root = Path(model_dir)
        path = require_file(root, "tokenizer.json")
        try:
            backend = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises plain Exception
            raise ModelLoadError(f"{path}: cannot load tokenizer: {exc}") from exc
        config = read_optional_json(root, "tokenizer_config.json")
        return cls(
            backend,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            chat_template=_chat_template(root, config),
            extra_eos_token_ids=extra_eos_token_ids,
            add_bos_token=config.get("add_bos_token"),
            fingerprint=fingerprint_text(path.read_bytes(), repr(sorted(config.items(), key=str))),
        )

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return self._fix_bos(ids) if add_special_tokens else ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for, a partial UTF-8 character included (for
        logprobs, as OpenAI gives them); b"" for an id outside the vocabulary."""
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level and piece not in self._special:
            try:
                return bytes(_UNICODE_TO_BYTE[ch] for ch in piece)
            except KeyError:
                pass
        return self.decode([token_id], skip_special_tokens=False).encode()

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages`; encode it with `encode_chat` or `encode(..., False)`.

        `tools` (OpenAI's `[{"type": "function", "function": {...}}]`) are given to the
        template as `tools`, as transformers' `apply_chat_template(tools=...)` gives them;
        None leaves `tools` undefined."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template")
        extra = {} if tools is None else {"tools": list(tools)}
        return render_chat_template(
            self.chat_template,
            messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[int]:
        # The template writes any BOS itself, so the tokenizer must not add another.
        return self.encode(
            self.apply_chat_template(messages, add_generation_prompt, tools),
            add_special_tokens=False,
        )

    def _fix_bos(self, ids: list[int]) -> list[int]:
        # tokenizer_config's add_bos_token wins over tokenizer.json's post-processor, as in transformers.
        bos = self.bos_token_id
        if bos is None or self._add_bos_token is None:
            return ids
        has_bos = bool(ids) and ids[0] == bos
        if self._add_bos_token and not has_bos:
            return [bos, *ids]
        if not self._add_bos_token and has_bos:
            return ids[1:]
        return ids


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's stand-in character for each byte: printable Latin-1 stands for
    itself, every other byte for a character from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    alphabet = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            alphabet[chr(256 + extra)] = b
            extra += 1
    return alphabet


_UNICODE_TO_BYTE = _byte_level_alphabet()


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    jinja_file = root / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None and (root / "chat_template.json").is_file():
        template = read_json(root / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        named = {
            item.get("name"): item.get("template") for item in template if isinstance(item, dict)
        }
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None
