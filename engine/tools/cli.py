"""The engine's `tollgate` subcommands: `models init-tiny` writes a random-weight model
(`engine.tools.tiny`), `models adapter-init` a random LoRA adapter for one
(`engine.tools.adapter_init`); `models fetch` and `models list` download known models into the
cache and show it (`engine.tools.fetch`, `engine.tools.model_list`); `models inspect`
sizes a model's weights and KV cache (`engine.tools.inspect`); `engine generate` runs one
prompt through `LLMEngine` in this process, without the services."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from engine.config import KV_DTYPES, QUANTIZATIONS
from engine.errors import EngineError


def register(subparsers: Any) -> None:
    """Add the engine's subcommands to the `tollgate` command's subparsers."""
    _register_models(subparsers)
    _register_engine(subparsers)


def _register_models(subparsers: Any) -> None:
    models = subparsers.add_parser("models", help="create and inspect model directories")
    models.set_defaults(func=lambda args: _usage(models))
    commands = models.add_subparsers(dest="models_command", metavar="COMMAND")
    init = commands.add_parser(
        "init-tiny", help="write a random-weight Llama or Qwen2 model in Hugging Face format"
    )
    init.add_argument("dir", help="directory to write (created if missing)")
    init.add_argument("--layers", type=int, default=2)
    init.add_argument("--hidden", type=int, default=64)
    init.add_argument("--heads", type=int, default=4)
    init.add_argument("--kv-heads", type=int, default=2)
    init.add_argument("--vocab", type=int, default=512, help="tokenizer vocabulary size (at most)")
    init.add_argument(
        "--intermediate", type=int, default=None, help="MLP width (default about 8/3 hidden)"
    )
    init.add_argument("--max-positions", type=int, default=8192)
    init.add_argument("--architecture", choices=["llama", "qwen2"], default="llama")
    init.add_argument("--seed", type=int, default=0)
    init.set_defaults(func=_init_tiny)
    _register_adapter_init(commands)
    _register_fetch(commands)


def _register_adapter_init(commands: Any) -> None:
    from engine.adapters import TARGET_MODULES

    adapter = commands.add_parser(
        "adapter-init", help="write a random-weight LoRA adapter (PEFT format) for a model"
    )
    adapter.add_argument("dir", help="directory to write (created if missing)")
    adapter.add_argument("--base", required=True, help="the base model's directory")
    adapter.add_argument("--rank", type=int, required=True, help="the LoRA rank r")
    adapter.add_argument("--alpha", type=float, default=None, help="lora_alpha (default: 2 r)")
    adapter.add_argument("--seed", type=int, default=0)
    adapter.add_argument(
        "--target",
        action="append",
        choices=TARGET_MODULES,
        default=None,
        help="a projection to adapt (repeatable; default: all of them)",
    )
    adapter.set_defaults(func=_adapter_init)


def _register_fetch(commands: Any) -> None:
    from engine.tools.registry import KNOWN_MODELS

    fetch = commands.add_parser(
        "fetch", help="download a known model and convert it to a Hugging Face directory"
    )
    fetch.add_argument("name", choices=sorted(KNOWN_MODELS), help="the model (see models list)")
    fetch.add_argument(
        "--dir", type=Path, default=None, help="where to write it (default: the model cache)"
    )
    fetch.set_defaults(func=_fetch)
    listing = commands.add_parser("list", help="the models that can be fetched and those cached")
    listing.add_argument(
        "--dir", type=Path, default=None, help="the cache (default: the model cache)"
    )
    listing.add_argument("--json", action="store_true", help="print one JSON document")
    listing.set_defaults(func=_list)
    _register_inspect(commands)


def _register_inspect(commands: Any) -> None:
    inspect = commands.add_parser(
        "inspect", help="a model's architecture, parameters, weight bytes and KV cache needs"
    )
    inspect.add_argument(
        "model", help="a Hugging Face model directory, a .gguf file or a known model"
    )
    inspect.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: the model's)"
    )
    inspect.add_argument("--concurrency", type=int, default=1, help="sequences at once")
    inspect.add_argument(
        "--kv-dtype", choices=KV_DTYPES, default="auto", help="KV cache dtype (auto: the model's)"
    )
    inspect.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    budget = inspect.add_mutually_exclusive_group()
    budget.add_argument(
        "--kv-blocks", type=int, default=512, help="the pool, in blocks (TOLLGATE_KV_BLOCKS)"
    )
    budget.add_argument("--kv-bytes", type=int, default=None, help="the pool, in bytes")
    inspect.add_argument("--json", action="store_true", help="print one JSON document")
    inspect.set_defaults(func=_inspect)


def _register_engine(subparsers: Any) -> None:
    engine = subparsers.add_parser("engine", help="run the inference engine offline")
    engine.set_defaults(func=lambda args: _usage(engine))
    commands = engine.add_subparsers(dest="engine_command", metavar="COMMAND")
    gen = commands.add_parser("generate", help="generate a completion for one prompt")
    gen.add_argument(
        "--model",
        required=True,
        help="a Hugging Face model directory, a .gguf file or a known model (models list)",
    )
    gen.add_argument("--prompt", required=True)
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user message in the chat template"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--threads", type=int, default=None)
    gen.add_argument(
        "--quantization",
        choices=["none", *QUANTIZATIONS],
        default="none",
        help="int8: weight-only, one scale per output channel",
    )
    gen.add_argument(
        "--kv-dtype", choices=KV_DTYPES, default="auto", help="KV cache dtype (auto: the model's)"
    )
    gen.add_argument(
        "--json", action="store_true", help='print {"token_ids": [...], "text": "..."}'
    )
    gen.set_defaults(func=_generate)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _init_tiny(args: argparse.Namespace) -> int:
    from engine.tools.tiny import init_tiny_model

    path = init_tiny_model(
        args.dir,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=args.kv_heads,
        vocab=args.vocab,
        intermediate=args.intermediate,
        seed=args.seed,
        max_position_embeddings=args.max_positions,
        architecture=args.architecture,
    )
    print(path)
    return 0


def _adapter_init(args: argparse.Namespace) -> int:
    from engine.adapters import TARGET_MODULES
    from engine.tools.adapter_init import init_adapter

    try:
        path = init_adapter(
            args.dir,
            args.base,
            rank=args.rank,
            alpha=args.alpha,
            seed=args.seed,
            target_modules=args.target or TARGET_MODULES,
        )
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _fetch(args: argparse.Namespace) -> int:
    from engine.tools.fetch import FetchError, fetch_model
    from engine.tools.registry import KNOWN_MODELS, model_cache, model_index

    try:
        path = fetch_model(
            KNOWN_MODELS[args.name],
            args.dir or model_cache(),
            index=model_index(),
            progress=_progress,
        )
    except (FetchError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def _list(args: argparse.Namespace) -> int:
    from engine.tools.model_list import listing_json, listing_text
    from engine.tools.registry import KNOWN_MODELS, model_cache

    render = listing_json if args.json else listing_text
    print(render(args.dir or model_cache(), KNOWN_MODELS))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.loader import load_model_config, resolve_dtype
    from engine.tools.fetch import FetchError, resolve_model
    from engine.tools.inspect import (
        ModelReport,
        count_parameters,
        kv_cache_figures,
        report_json,
        report_text,
        weight_bytes,
    )

    try:
        name, model_dir = resolve_model(args.model, progress=_progress)
        config = load_model_config(model_dir)
        params = count_parameters(_tensor_shapes(model_dir), config.tie_word_embeddings)
        # "auto" is the dtype the engine runs the model in, not the checkpoint's.
        kv_dtype = args.kv_dtype
        if kv_dtype == "auto":
            kv_dtype = str(resolve_dtype(EngineConfig().dtype, config)).removeprefix("torch.")
        context = args.context or config.max_position_embeddings
        _check_positive(context=context, concurrency=args.concurrency, block_size=args.block_size)
        kv = kv_cache_figures(
            config,
            num_tokens=min(context, config.max_position_embeddings),
            concurrency=args.concurrency,
            kv_dtype=kv_dtype,
            block_size=args.block_size,
            budget_blocks=None if args.kv_bytes is not None else args.kv_blocks,
            budget_bytes=args.kv_bytes,
        )
    except (EngineError, FetchError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    report = ModelReport(name, config, params, weight_bytes(params), kv)
    print(report_json(report) if args.json else report_text(report))
    return 0


def _tensor_shapes(model_dir: Path) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor's (name, shape), read from the safetensors headers only."""
    from safetensors import safe_open

    from engine.model_files import weight_files

    shapes = []
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                shapes.append((name, tuple(handle.get_slice(name).get_shape())))
    return shapes


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} must be positive, not {value}")


def _generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model_config, load_tokenizer
    from engine.sampling import SamplingParams
    from engine.tools.fetch import FetchError, resolve_model

    try:
        _, model_dir = resolve_model(args.model, progress=_progress)
        tokenizer = load_tokenizer(model_dir, load_model_config(model_dir))
        if args.chat:
            prompt = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
        else:
            prompt = tokenizer.encode(args.prompt)
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
            stop=tuple(args.stop),
            ignore_eos=args.ignore_eos,
        )
        # A pool sized for this one request: nothing else will run.
        block_size = 16
        blocks = -(-(len(prompt) + args.max_tokens) // block_size) + 1
        config = EngineConfig(
            num_threads=args.threads,
            block_size=block_size,
            num_kv_blocks=blocks,
            quantization=None if args.quantization == "none" else args.quantization,
            kv_dtype=args.kv_dtype,
        )
        engine = LLMEngine.from_model_dir(model_dir, config)
        engine.add_request("cli", prompt, params)
    except (EngineError, FetchError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    token_ids: list[int] = []
    text: list[str] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            token_ids.extend(out.new_token_ids)
            text.append(out.text_delta)
            if not args.json:
                sys.stdout.write(out.text_delta)
                sys.stdout.flush()
    if args.json:
        print(json.dumps({"token_ids": token_ids, "text": "".join(text)}, ensure_ascii=False))
    else:
        sys.stdout.write("\n")
    return 0
