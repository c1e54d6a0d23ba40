"""How each kind of engine server is spoken to, free of I/O: the request body a run becomes,
and what each streamed chunk of the answer says.

Every kind takes the prompt as token ids. vLLM (`/v1/completions` with
`return_token_ids`), SGLang (`/generate`) and llama.cpp's server (`/completion` with
`return_tokens`) send back the generated token ids with each chunk; a plain
OpenAI-compatible server (`openai`) sends text only, and its tokens are counted by
tokenizing that text. The versions each shape was checked against are in
`tests/fixtures/engines/`.

A run's JSON schema goes to the servers that take one (vLLM, SGLang, llama-server), its
Lark grammar to vLLM alone, and its logprobs are asked of and read back from the three
that name tokens by id. What a kind cannot honour is in UNSUPPORTED, for admission to
refuse, and a run that asks for it anyway fails rather than lose its format or logprobs.

* `wire`: what every kind shares: `Request`, `Delta`, `Reader`, `Dialect`, the helpers
  that read a chunk's values, `cache_salt`, and the SSE (`sse_data`) and Prometheus
  (`waiting`) text.
* `refusals`: what each kind cannot honour (`UNSUPPORTED`, `unsupported`, `UNSENDABLE`).
* `completions`: OpenAI's and vLLM's `/v1/completions` bodies and `CompletionsReader`.
* `sglang`, `llama_server`: each kind's body and reader.

DIALECTS, below, names each kind's path, body and reader.
"""

from engine.dialects.completions import (
    OPENAI_FINISH,
    CompletionsReader,
    openai_body,
    vllm_body,
)
from engine.dialects.llama_server import LLAMA_STOP, LlamaServerReader, llama_server_body
from engine.dialects.refusals import (
    NEUTRAL,
    NO_ANSWERS,
    NO_LARK,
    NO_LOGPROB_IDS,
    NO_OUTPUT_FORMAT,
    UNSENDABLE,
    UNSUPPORTED,
    Refusal,
    Sampling,
    unsupported,
)
from engine.dialects.sglang import SGLANG_FINISH, SGLangReader, sglang_body
from engine.dialects.wire import (
    DONE,
    KINDS,
    Delta,
    Dialect,
    MalformedChunk,
    Reader,
    Request,
    cache_salt,
    sse_data,
    waiting,
)

DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect(
        "vllm",
        "/v1/completions",
        vllm_body,
        lambda logprobs: CompletionsReader(token_ids=True, logprobs=logprobs),
        waiting_metric="vllm:num_requests_waiting",
    ),
    "sglang": Dialect(
        "sglang",
        "/generate",
        sglang_body,
        SGLangReader,
        waiting_metric="sglang:num_queue_reqs",
    ),
    "llama-server": Dialect(
        "llama-server",
        "/completion",
        llama_server_body,
        LlamaServerReader,
        waiting_metric="llamacpp:requests_deferred",
        done_marker=False,
    ),
    "openai": Dialect(
        "openai",
        "/v1/completions",
        openai_body,
        lambda _: CompletionsReader(token_ids=False),
        health_path="/v1/models",
        metrics_path="",
    ),
}

__all__ = [
    "DIALECTS",
    "DONE",
    "KINDS",
    "LLAMA_STOP",
    "NEUTRAL",
    "NO_ANSWERS",
    "NO_LARK",
    "NO_LOGPROB_IDS",
    "NO_OUTPUT_FORMAT",
    "OPENAI_FINISH",
    "SGLANG_FINISH",
    "UNSENDABLE",
    "UNSUPPORTED",
    "CompletionsReader",
    "Delta",
    "Dialect",
    "LlamaServerReader",
    "MalformedChunk",
    "Reader",
    "Refusal",
    "Request",
    "SGLangReader",
    "Sampling",
    "cache_salt",
    "llama_server_body",
    "openai_body",
    "sglang_body",
    "sse_data",
    "unsupported",
    "vllm_body",
    "waiting",
]
