"""Two CPU processes over gloo: a tiledsl program called on DTensors equals the unsharded
run, forward and backward (tests/test_sharding.py runs `python sharded_worker.py CASE`).

Each case is (program, the arguments' full values, their placements, the placements the
outputs must have). Every rank builds the same full tensors from one seed, distributes
them, calls the program, and compares the gathered outputs and gradients with the program
called on the full tensors; rank 0 prints "ok" when both ranks agreed.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DeviceMesh, DTensor, Partial, Replicate, Shard, distribute_tensor

import tiledsl

CASES = {
    "rmsnorm_rows": (
        "kernel f(x: f32[M, D], w: f32[D], eps: f32) -> f32[M, D] {"
        " return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + eps) * w }",
        lambda g: (torch.randn(6, 33, generator=g), torch.rand(33, generator=g) + 0.5, 1e-5),
        (Shard(0), Replicate(), None), (Shard(0),)),
    "column_parallel": (
        "kernel f(x: f32[M, K], w: f32[K, N], b: f32[N]) -> f32[M, N] { return gelu(x @ w + b) }",
        lambda g: (torch.randn(5, 16, generator=g), torch.randn(16, 12, generator=g) * 0.3,
                   torch.randn(12, generator=g)),
        (Replicate(), Shard(1), Shard(0)), (Shard(1),)),
    "row_parallel": (
        "kernel f(x: f32[M, K], w: f32[K, N]) -> f32[M, N] { return x @ w }",
        lambda g: (torch.randn(5, 16, generator=g), torch.randn(16, 12, generator=g) * 0.3),
        (Shard(1), Shard(0)), (Partial(),)),
    "attention_heads": (
        "kernel f(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D]) -> f32[B, H, M, D] {"
        " s = q @ k.T * rsqrt(D); s = where(causal(s), s, -inf); return softmax(s, axis=-1) @ v }",
        lambda g: tuple(torch.randn(2, 4, 9, 8, generator=g) for _ in range(3)),
        (Shard(1), Shard(1), Shard(1)), (Shard(1),)),
    "rmsnorm_reduced_dim": (  # sharded along the dim it reduces: DTensor replicates x first
        "kernel f(x: f32[M, D], w: f32[D], eps: f32) -> f32[M, D] {"
        " return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + eps) * w }",
        lambda g: (torch.randn(6, 32, generator=g), torch.rand(32, generator=g) + 0.5, 1e-5),
        (Shard(1), Replicate(), None), (Replicate(),)),
    "generic_rmsnorm_batch": (
        "kernel f[T: f32 | bf16](x: T[..., D], w: T[D], eps: f32) -> T[..., D] {"
        " xf = cast(x, f32); return xf * rsqrt(mean(xf * xf, axis=-1, keepdims=true) + eps) * w }",
        lambda g: (torch.randn(4, 3, 17, generator=g), torch.rand(17, generator=g) + 0.5, 1e-6),
        (Shard(0), Replicate(), None), (Shard(0),)),
}


def run(rank: int, case: str, init: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        mesh = DeviceMesh("cpu", [0, 1])
        src, make, placements, expected = CASES[case]
        fn = tiledsl.compile(src)
        full = make(torch.Generator().manual_seed(0))
        tensors = [i for i, a in enumerate(full) if isinstance(a, torch.Tensor)]
        plain = [a.clone().requires_grad_() if isinstance(a, torch.Tensor) else a for a in full]
        out = fn(*plain)
        cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
        (out * cot).sum().backward()
        sharded = [distribute_tensor(a.detach(), mesh, [p]).requires_grad_() if isinstance(a, torch.Tensor)
                   else a for a, p in zip(full, placements, strict=True)]
        got = fn(*sharded)
        assert isinstance(got, DTensor), type(got)
        assert tuple(got.placements) == expected, (got.placements, expected)
        torch.testing.assert_close(got.full_tensor(), out.detach(), rtol=1e-5, atol=1e-6)
        dcot = distribute_tensor(cot, mesh, [Replicate()]).redistribute(mesh, got.placements) \
            if not isinstance(expected[0], Partial) else distribute_tensor(cot, mesh, [Replicate()])
        (got.redistribute(mesh, [Replicate()]) * dcot.redistribute(mesh, [Replicate()])).sum().backward()
        for i in tensors:
            grad = sharded[i].grad
            assert grad is not None, f"argument {i} has no gradient"
            full_grad = grad.full_tensor() if isinstance(grad, DTensor) else grad
            torch.testing.assert_close(full_grad, plain[i].grad, rtol=1e-5, atol=1e-6)
        dist.barrier()
        if rank == 0:
            print("ok")
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    case = sys.argv[1]
    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.start_processes(run, args=(case, init), nprocs=2, start_method="fork")
