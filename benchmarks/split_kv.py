"""Split-KV decode attention (flash-decoding) against the same kernel unsplit and against
torch's scaled_dot_product_attention.

    python benchmarks/split_kv.py                          # on a CUDA GPU
    python benchmarks/split_kv.py --device cpu --quick     # a smoke run through the interpreter

It times, in one run and on the same random f16 inputs (each result checked against torch
before it is timed), one query row per (batch, head) against L keys:
  decode B=1 H=32 D=128, L = 4096, 32768
  GQA decode B=1 H=32 KH=8 D=128, L = 32768
    split    tiledsl's kernel as the launch builder splits it (the splits column)
    unsplit  the same program with @tile(SPLITS=1): one program per (batch, head)
    sdpa     torch.nn.functional.scaled_dot_product_attention (GQA: enable_gqa)
and prints milliseconds and baseline time / tiledsl time (above 1: tiledsl is faster).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import arguments, bench, close, open_device, print_header  # noqa: E402

import tiledsl  # noqa: E402

DECODE = """{hint}
kernel decode(q: f16[B, H, D], k: f16[B, H, L, D], v: f16[B, H, L, D]) -> f16[B, H, D] {{
    s = q[:, :, None, :] @ k.T * rsqrt(D)
    return (softmax(s) @ v)[:, :, 0, :]
}}"""
GQA = """{hint}
kernel gqa(q: f16[B, H, D], k: f16[B, KH, L, D], v: f16[B, KH, L, D]) -> f16[B, H, D] {{
    qg = reshape(q, [B, KH, H // KH, 1, D])
    s = qg @ k[:, :, None].T * rsqrt(D)
    return reshape(softmax(s) @ v[:, :, None], [B, H, D])
}}"""


def splits_of(fn, dims: dict[str, int], device: str) -> int:
    """The split count the launch builder chose for these sizes."""
    from tiledsl.backends.triton import aot

    launch = aot.meta_launches(fn, dims, {})[0]
    target = "cuda" if device == "cuda" else "interpreter"
    return launch.kernel.launch_config(dims, target).constexprs["SPLITS"]


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__).parse_args(argv)
    if not open_device("split_kv.py", args.device):
        return 0
    dev, g = args.device, torch.Generator().manual_seed(0)
    h, kh, d = (4, 2, 32) if args.quick else (32, 8, 128)
    cases = [("decode", h, h, 1000), ("gqa", h, kh, 1000)] if args.quick else \
        [("decode", h, h, 4096), ("decode", h, h, 32768), ("gqa", h, kh, 32768)]
    print_header(f"{'case':<32} | {'splits':>6} | {'tiledsl ms':>10} | {'baseline':<9} {'ms':>9} | ratio")

    def line(case: str, splits: int, ours: float, name: str, base: float) -> None:
        print(f"{case:<32} | {splits:>6} | {ours:>10.4f} | {name:<9} {base:>9.4f} | {base / ours:5.2f}")

    for name, heads, kv_heads, length in cases:
        src = DECODE if name == "decode" else GQA
        split, unsplit = (tiledsl.compile(src.format(hint=hint)) for hint in ("", "@tile(SPLITS=1)"))
        q = torch.randn(1, heads, d, generator=g).to(torch.float16).to(dev)
        k = torch.randn(1, kv_heads, length, d, generator=g).to(torch.float16).to(dev)
        v = torch.randn(1, kv_heads, length, d, generator=g).to(torch.float16).to(dev)

        def sdpa(q=q, k=k, v=v, gqa=name == "gqa"):
            return F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=gqa)[:, :, 0]

        want = sdpa().float()
        for fn, what in ((split, "split"), (unsplit, "unsplit")):
            close(fn(q, k, v), want, f"{name} {what}", 2e-3)
        dims = {"B": 1, "H": heads, "L": length, "D": d} | ({"KH": kv_heads} if name == "gqa" else {})
        splits = splits_of(split, dims, dev)
        ours = bench(lambda split=split, q=q, k=k, v=v: split(q, k, v), dev)
        case = f"{name} H={heads} KH={kv_heads} L={length}"
        base = bench(lambda unsplit=unsplit, q=q, k=k, v=v: unsplit(q, k, v), dev)
        line(case, splits, ours, "unsplit", base)
        line(case, splits, ours, "sdpa", bench(sdpa, dev))
    return 0


if __name__ == "__main__":
    sys.exit(main())
