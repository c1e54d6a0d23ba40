"""The decoder's projections four ways, by number of rows: x @ W^T, W @ x^T, oneDNN with
the weight prepacked, and the native kernel with the weight in panels.

`engine/layers/linear.py` packs fp32 weights in panels for the native kernel, or where
that does not build, for oneDNN where PyTorch can, and otherwise multiplies as W @ x^T for
few rows; this measures why. The weights of all layers of the benchmark model are cycled
through, so each multiply reads its weight from memory as it does in a real step, not
from cache.

    python -m bench.linear [--layers 8 --hidden 512 --intermediate 1408 --kv-heads 4 --threads 2]

Last line: one JSON object: for each way but the first, rows -> (x @ W^T seconds) /
(its seconds); null where a way is unavailable.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine import native
from engine.layers.linear import can_pack, pack_weight, packed_linear

ROWS = (1, 4, 16, 64, 128, 512)
# One product: (weight, input) -> output; built once per way from the weight.
Multiply = Callable[[torch.Tensor], torch.Tensor]


def _best_of(repeats: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def ways(weight: torch.Tensor) -> dict[str, Multiply | None]:
    """Each way of computing x @ weight^T, None where this build lacks it."""
    gemm = native.gemm()
    panels = native.pack_panels(weight) if gemm else None
    packed = pack_weight(weight) if can_pack(weight) else None
    out_features = weight.shape[0]
    return {
        "x @ W^T": lambda x: F.linear(x, weight),
        "W @ x^T": lambda x: torch.mm(weight, x.t()),
        "oneDNN": (lambda x: packed_linear(x, packed)) if packed is not None else None,
        "panels": (
            (lambda x: gemm(x, panels, None, out_features))
            if gemm is not None and panels is not None
            else None
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    h, i = args.hidden, args.intermediate
    qkv = h + 2 * h // args.heads * args.kv_heads
    shapes = [(qkv, h), (h, h), (2 * i, h), (h, i)]  # qkv, o, gate_up, down
    weights = [torch.randn(out, inp) for _ in range(args.layers) for out, inp in shapes]
    multiplies = [ways(w) for w in weights]
    names = list(multiplies[0])
    ratios: dict[str, dict[int, float | None]] = {name: {} for name in names[1:]}
    print(f"{'rows':>5}" + "".join(f"{name:>10}" for name in names) + "   (ms; best of repeats)")
    for rows in ROWS:
        inputs = {inp: torch.randn(rows, inp) for _, inp in shapes}
        seconds: dict[str, float] = {}
        for name in names:
            if multiplies[0][name] is None:
                continue

            def run(name: str = name, inputs: dict[int, torch.Tensor] = inputs) -> None:
                for weight, way in zip(weights, multiplies, strict=True):
                    multiply = way[name]
                    assert multiply is not None
                    multiply(inputs[weight.shape[1]])

            seconds[name] = _best_of(args.repeats, run)
        baseline = seconds["x @ W^T"]
        for name in names[1:]:
            ratios[name][rows] = round(baseline / seconds[name], 2) if name in seconds else None
        cells = "".join(
            f"{1e3 * seconds[name]:>10.1f}" if name in seconds else f"{'-':>10}" for name in names
        )
        print(f"{rows:>5}{cells}")
    print(json.dumps({"threads": args.threads, "x_wt_over": ratios}))


if __name__ == "__main__":
    main()
