"""Keys of the prefix cache: a chained hash over full blocks, rooted in a namespace key."""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Sequence
from dataclasses import astuple, dataclass

DIGEST_SIZE = 16


@dataclass(frozen=True, slots=True)
class PrefixKey:
    """Everything that must match for two requests to share cached KV blocks.

    `namespace` is the caller's security domain (a tenant); the rest pins the numbers
    stored in a block to the model, tokenizer, chat template, adapter, KV dtype, block size
    and weight quantization.
    """

    namespace: str
    model_fingerprint: str
    tokenizer_fingerprint: str
    template_fingerprint: str
    adapter_fingerprint: str
    kv_dtype: str
    block_size: int
    quantization: str = ""

    def root(self) -> bytes:
        """The hash every chain of this key starts from."""
        encoded = json.dumps(astuple(self), separators=(",", ":")).encode()
        return hashlib.blake2b(encoded, digest_size=DIGEST_SIZE, person=b"tollgate-prefix").digest()


def hash_block(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """Hash of one full block, chained to the hash of the block before it (or the root)."""
    digest = hashlib.blake2b(parent, digest_size=DIGEST_SIZE)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()
