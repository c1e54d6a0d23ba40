"""`tollgate engine generate`: one prompt through `LLMEngine` in this process, without the
services."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from engine.config import KV_DTYPES, QUANTIZATIONS
from engine.errors import EngineError


def register(subparsers: Any) -> None:
    """Adds `engine` to the `tollgate` command line."""
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


def _generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model_config, load_tokenizer
    from engine.model_dirs.fetch import FetchError, resolve_model
    from engine.sampling import SamplingParams

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
