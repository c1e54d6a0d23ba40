"""Structured outputs: a request's JSON schema or Lark grammar, compiled by llguidance into a
matcher that says, token by token, which tokens may come next.

`Grammars` sits between the engine and llguidance: it builds llguidance's view of the
tokenizer once, compiles each distinct schema or grammar once, and hands every request a
matcher of its own. Admission, which has the tokenizer but no model, checks requests with
the same class. No torch here: masks are numpy bitmasks, one bit per token.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import llguidance.numpy
import numpy as np
import numpy.typing as npt

from engine.errors import RequestError
from engine.structure import JSON_LAYOUT, json_value
from engine.tokenizer import Tokenizer

# Compiled grammars kept for reuse, least recently used dropped first.
MAX_CACHED_GRAMMARS = 64
# llguidance's messages can quote a whole grammar; a user needs the start.
MAX_ERROR_CHARS = 500

Bitmask = npt.NDArray[np.int32]


class Grammars:
    """Compiled JSON schemas and grammars for one tokenizer, and the masks they give.

    `vocab_size` is the model's (its logits' width; default the tokenizer's): tokens
    beyond the tokenizer's are never allowed. llguidance's tokenizer is built on the first
    request that needs it, so an engine that never sees a grammar never pays for it.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or tokenizer.vocab_size
        # How many schemas and grammars were compiled (the cache's misses).
        self.num_compiled = 0
        self._lltokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[str, llguidance.LLMatcher] = OrderedDict()

    def check(self, json_schema: str = "", grammar: str = "") -> None:
        """Raises RequestError, naming the field and llguidance's complaint, when the
        schema or grammar cannot be compiled."""
        self._pristine(json_schema, grammar)

    def matcher(self, json_schema: str = "", grammar: str = "") -> llguidance.LLMatcher:
        """A fresh matcher for one request, at the start of its output; raises
        RequestError as `check` does."""
        return self._pristine(json_schema, grammar).deep_copy()

    def masks(self, matchers: Sequence[llguidance.LLMatcher]) -> Bitmask:
        """[len(matchers), ceil(vocab_size / 32)]: row i has bit t % 32 of word t // 32 set
        where matchers[i] allows token t next; all rows in one parallel call."""
        bitmask = llguidance.numpy.allocate_token_bitmask(len(matchers), self.vocab_size)
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        llguidance.numpy.fill_next_token_bitmask_par(
            self._executor, [(m, i) for i, m in enumerate(matchers)], bitmask
        )
        return bitmask

    def _pristine(self, json_schema: str, grammar: str) -> llguidance.LLMatcher:
        field, text = ("json_schema", json_schema) if json_schema else ("grammar", grammar)
        key = hashlib.sha256(f"{field}\0{text}".encode()).hexdigest()
        compiled = self._compiled.get(key)
        if compiled is not None:
            self._compiled.move_to_end(key)
            return compiled
        compiled = llguidance.LLMatcher(self._llguidance_tokenizer(), _grammar(field, text))
        self.num_compiled += 1
        if compiled.is_error():
            raise RequestError(_shortened(f"{field}: {compiled.get_error()}"))
        self._compiled[key] = compiled
        if len(self._compiled) > MAX_CACHED_GRAMMARS:
            self._compiled.popitem(last=False)
        return compiled

    def _llguidance_tokenizer(self) -> llguidance.LLTokenizer:
        if self._lltokenizer is None:
            try:
                self._lltokenizer = llguidance.LLTokenizer(
                    self.tokenizer.backend.to_str(),
                    n_vocab=self.vocab_size,
                    eos_token=list(self.tokenizer.eos_token_ids) or None,
                )
            except Exception as exc:  # the Rust library raises plain Exception
                raise RequestError(
                    _shortened(f"structured output is not available for this tokenizer: {exc}")
                ) from exc
        return self._lltokenizer


def _grammar(field: str, text: str) -> str:
    """llguidance's grammar for a request's json_schema or Lark grammar."""
    if field == "grammar":
        return llguidance.LLMatcher.grammar_from_lark(text)
    try:
        schema = json_value(text)
    except ValueError as exc:
        raise RequestError(f"json_schema: not valid JSON: {exc}") from None
    if schema is True:
        schema = {}  # the schema that allows any JSON value, in the form options apply to
    if not isinstance(schema, dict):
        raise RequestError("json_schema: a schema is a JSON object (or true)")
    try:
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
    except ValueError as exc:
        raise RequestError(_shortened(f"json_schema: {exc}")) from None


def consume(matcher: llguidance.LLMatcher, token_id: int) -> bool:
    """Advance `matcher` past a sampled token; True when the grammar allows nothing more
    (complete, or the token refused, which the masks rule out)."""
    matcher.consume_token(token_id)
    return matcher.is_stopped()


def _shortened(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[: MAX_ERROR_CHARS - 1] + "…"
