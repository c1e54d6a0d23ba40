"""Which engine a worker drives: the built-in one in a child process, an engine server over
HTTP, or the simulated one; read from the environment (DESIGN §9)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig
from engine.dialects import KINDS
from engine.front import EngineFront
from engine.loader import load_model_config
from engine.outputs import RequestOutput
from engine.process_engine import ProcessEngine
from engine.remote_engine import RemoteConfig, RemoteEngine
from engine.sim_engine import SimConfig, SimEngine
from engine.tokenizer import Tokenizer
from services.core.config import ConfigError, env_choice, env_float, env_int, env_str

BUILTIN, SIM = "builtin", "sim"
ENGINE_KINDS = (BUILTIN, *KINDS, SIM)

OnStep = Callable[[list[RequestOutput]], None]
StartEngine = Callable[[], Awaitable[EngineFront]]


@dataclass(frozen=True, slots=True)
class EngineSettings:
    kind: str = BUILTIN
    url: str = ""
    # The model's name on the engine server; "" = the name the worker serves.
    model: str = ""
    api_key: str = ""
    max_running: int = 16
    # 0: what the server reports, else the model's own.
    max_model_len: int = 0
    chunk_timeout: float = 30.0
    share_cache: bool = False
    send_priority: bool = False
    sim_step_seconds: float = 0.02
    sim_prefill_tokens_per_s: float = 20_000.0

    @classmethod
    def from_env(cls) -> EngineSettings:
        kind = env_choice("TOLLGATE_ENGINE_KIND", BUILTIN, ENGINE_KINDS)
        url = env_str("TOLLGATE_ENGINE_URL", "")
        if kind in KINDS and not url:
            raise ConfigError(f"TOLLGATE_ENGINE_KIND={kind} needs TOLLGATE_ENGINE_URL")
        if url and kind not in KINDS:
            raise ConfigError(
                f"TOLLGATE_ENGINE_URL needs TOLLGATE_ENGINE_KIND, one of {', '.join(KINDS)}"
            )
        settings = cls(
            kind=kind,
            url=url,
            model=env_str("TOLLGATE_ENGINE_MODEL", ""),
            api_key=env_str("TOLLGATE_ENGINE_API_KEY", ""),
            max_running=env_int("TOLLGATE_ENGINE_MAX_RUNS", 256 if kind == SIM else 16),
            max_model_len=env_int("TOLLGATE_ENGINE_MAX_MODEL_LEN", 0),
            chunk_timeout=env_float("TOLLGATE_ENGINE_TIMEOUT", 30.0),
            share_cache=env_flag("TOLLGATE_ENGINE_CACHE_PROMPT"),
            send_priority=env_flag("TOLLGATE_ENGINE_PRIORITY"),
            sim_step_seconds=env_float("TOLLGATE_SIM_STEP_MS", 20.0) / 1000,
            sim_prefill_tokens_per_s=env_float("TOLLGATE_SIM_PREFILL_TOKENS_PER_S", 20_000.0),
        )
        for name, value in (
            ("TOLLGATE_ENGINE_MAX_RUNS", settings.max_running),
            ("TOLLGATE_ENGINE_TIMEOUT", settings.chunk_timeout),
            ("TOLLGATE_SIM_STEP_MS", settings.sim_step_seconds),
            ("TOLLGATE_SIM_PREFILL_TOKENS_PER_S", settings.sim_prefill_tokens_per_s),
        ):
            if value <= 0:
                raise ConfigError(f"{name} must be positive")
        if settings.max_model_len < 0:
            raise ConfigError("TOLLGATE_ENGINE_MAX_MODEL_LEN must not be negative")
        return settings

    @property
    def is_remote(self) -> bool:
        return self.kind in KINDS


def env_flag(name: str) -> bool:
    value = env_str(name, "false").lower()
    if value not in ("true", "false", "1", "0"):
        raise ConfigError(f"{name} must be true or false, got {value!r}")
    return value in ("true", "1")


def engine_starter(
    settings: EngineSettings,
    served_name: str,
    model_dir: str,
    engine_config: EngineConfig,
    on_step: OnStep,
    niceness: int = 0,
) -> StartEngine:
    """What starts (and, after a loss, restarts) the worker's engine."""
    if settings.kind == BUILTIN:
        return lambda: ProcessEngine.start(model_dir, engine_config, on_step, niceness=niceness)
    config = load_model_config(model_dir)
    max_model_len = settings.max_model_len or config.max_position_embeddings
    tokenizer = Tokenizer.from_model_dir(model_dir)
    if settings.kind == SIM:
        sim = SimConfig(
            vocab_size=config.vocab_size,
            max_model_len=max_model_len,
            step_seconds=settings.sim_step_seconds,
            max_running=settings.max_running,
            prefill_tokens_per_s=settings.sim_prefill_tokens_per_s,
            block_size=engine_config.block_size,
            num_blocks=engine_config.num_kv_blocks or 512,
        )
        vocabulary = sim_vocabulary(tokenizer, config.vocab_size)

        async def start_sim() -> EngineFront:
            return SimEngine(sim, on_step, vocabulary)

        return start_sim
    remote = RemoteConfig(
        kind=settings.kind,
        url=settings.url,
        model=settings.model or served_name,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        api_key=settings.api_key,
        max_running=settings.max_running,
        block_size=engine_config.block_size,
        chunk_timeout=settings.chunk_timeout,
        share_cache=settings.share_cache,
        send_priority=settings.send_priority,
    )
    encode: Callable[[str], list[int]] | None = None
    if settings.kind == "openai":

        def encode(text: str) -> list[int]:
            return tokenizer.encode(text, add_special_tokens=False)

    async def start_remote() -> EngineFront:
        return await RemoteEngine.start(remote, on_step, encode)

    return start_remote


def sim_vocabulary(
    tokenizer: Tokenizer, vocab_size: int, size: int = 1000
) -> list[tuple[int, str]]:
    """Token ids whose text is a plain word of the model's vocabulary, so that a simulated
    run's text is what its token ids decode to."""
    words: list[tuple[int, str]] = []
    for token_id in range(min(vocab_size, 50_000)):
        text: Any = tokenizer.decode([token_id])
        if isinstance(text, str) and text.startswith(" ") and text[1:].isalpha():
            words.append((token_id, text))
            if len(words) == size:
                break
    return words
