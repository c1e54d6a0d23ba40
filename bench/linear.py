"""The decoder's projections three ways, by number of rows: x @ W^T, W @ x^T, and
oneDNN with the weight prepacked.

`engine/layers/linear.py` packs fp32 weights for oneDNN where PyTorch can, and otherwise
multiplies as W @ x^T for few rows; this measures why. The weights of all layers of the
benchmark model are cycled through, so each multiply reads its weight from memory as it
does in a real step, not from cache.

    python -m bench.linear [--layers 8 --hidden 512 --intermediate 1408 --kv-heads 4 --threads 2]

Last line: one JSON object, rows -> (x @ W^T seconds) / (W @ x^T seconds) and
rows -> (x @ W^T seconds) / (packed seconds).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.layers.linear import can_pack, pack_weight, packed_linear

ROWS = (1, 4, 16, 64, 128, 512)


def _best_of(repeats: int, run: Callable[[], None]) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


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
    layers = [[torch.randn(out, inp) for out, inp in shapes] for _ in range(args.layers)]

    packable = can_pack(layers[0][0])
    packed_layers = [[pack_weight(w) for w in weights] for weights in layers] if packable else []
    ratios: dict[int, float] = {}
    packed_ratios: dict[int, float | None] = {}
    print(f"{'rows':>5} {'x @ W^T':>10} {'W @ x^T':>10} {'packed':>10} {'ratio':>6} {'ratio':>6}")
    for rows in ROWS:
        inputs = {inp: torch.randn(rows, inp) for _, inp in shapes}

        def linear(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weights in layers:
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)

        def streamed(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weights in layers:
                for w in weights:
                    torch.mm(w, inputs[w.shape[1]].t())

        def packed(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weights, packs in zip(layers, packed_layers, strict=True):
                for w, p in zip(weights, packs, strict=True):
                    packed_linear(inputs[w.shape[1]], p)

        a, b = _best_of(args.repeats, linear), _best_of(args.repeats, streamed)
        c = _best_of(args.repeats, packed) if packable else float("nan")
        ratios[rows] = round(a / b, 2)
        packed_ratios[rows] = round(a / c, 2) if packable else None  # JSON null
        print(
            f"{rows:>5} {1e3 * a:>8.1f}ms {1e3 * b:>8.1f}ms {1e3 * c:>8.1f}ms"
            f" {a / b:>6.2f} {a / c:>6.2f}"
        )
    print(
        json.dumps(
            {
                "threads": args.threads,
                "x_wt_over_w_xt": ratios,
                "x_wt_over_packed": packed_ratios,
            }
        )
    )


if __name__ == "__main__":
    main()
