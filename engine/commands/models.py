"""`tollgate models`: `init-tiny` writes a random-weight model (`engine.model_dirs.tiny`),
`adapter-init` a random LoRA adapter for one (`engine.model_dirs.adapter_init`); `fetch` and
`list` download known models into the cache and show it (`engine.model_dirs.fetch`,
`engine.model_dirs.model_list`); `inspect` sizes a model's weights and KV cache
(`engine.model_dirs.inspect`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from engine.config import KV_DTYPES
from engine.errors import EngineError


def register(subparsers: Any) -> None:
    """Adds `models` to the `tollgate` command line."""
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
    from engine.model_dirs.registry import KNOWN_MODELS

    fetch = commands.add_parser(
        "fetch", help="download a known model and convert it to a Hugging Face directory"
    )
    fetch.add_argument("name", choices=sorted(KNOWN_MODELS), help="the model (see models list)")
    fetch.add_argument(
        "--dir", type=Path, default=None, help="where to write it (default: the model cache)"
    )
    fetch.add_argument(
        "--gguf",
        action="store_true",
        help="keep the GGUF file as shipped, unconverted, and print its path (for llama-server)",
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


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _init_tiny(args: argparse.Namespace) -> int:
    from engine.model_dirs.tiny import init_tiny_model

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
    from engine.model_dirs.adapter_init import init_adapter

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
    from engine.model_dirs.fetch import FetchError, fetch_gguf, fetch_model
    from engine.model_dirs.registry import KNOWN_MODELS, model_cache, model_index

    try:
        path = (fetch_gguf if args.gguf else fetch_model)(
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
    from engine.model_dirs.model_list import listing_json, listing_text
    from engine.model_dirs.registry import KNOWN_MODELS, model_cache

    render = listing_json if args.json else listing_text
    print(render(args.dir or model_cache(), KNOWN_MODELS))
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.loader import load_model_config, resolve_dtype
    from engine.model_dirs.fetch import FetchError, resolve_model
    from engine.model_dirs.inspect import (
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
