"""DTensor sharding rules derived from the program (issue 30): which dims shard through
(batch dims everywhere), which give Partial outputs (sums and contractions returned as
such), and, over two CPU processes with gloo, sharded calls equal the unsharded run,
forward and backward (`sharded_worker.py`)."""

import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import tiledsl
from tiledsl import sharding

RMSNORM = ("kernel f(x: f32[M, D], w: f32[D], eps: f32) -> f32[M, D] {"
           " return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + eps) * w }")


def rules(src: str) -> list:
    return sharding.rules(tiledsl.compile(src).source_graph)


def test_rows_shard_and_the_normalized_dim_does_not():
    assert rules(RMSNORM) == [([Replicate()], [Replicate(), Replicate(), None]),
                              ([Shard(0)], [Shard(0), Replicate(), None])]


def test_a_linear_layer_shards_its_rows_and_columns_and_its_contraction_is_partial():
    col = rules("kernel f(x: f32[M, K], w: f32[K, N], b: f32[N]) -> f32[M, N] { return gelu(x @ w + b) }")
    assert ([Shard(1)], [Replicate(), Shard(1), Shard(0)]) in col
    assert ([Shard(0)], [Shard(0), Replicate(), Replicate()]) in col
    assert not any(isinstance(p, Shard) and p.dim == 1 for _, ins in col for p in ins[:1])  # K: gelu after the sum
    row = rules("kernel f(x: f32[M, K], w: f32[K, N]) -> f32[M, N] { return x @ w }")
    assert ([Partial()], [Shard(1), Shard(0)]) in row


def test_attention_shards_over_batch_and_heads_only():
    out = rules("kernel f(q: f32[B, H, M, D], k: f32[B, H, N, D], v: f32[B, H, N, D]) -> f32[B, H, M, D] {"
                " s = q @ k.T * rsqrt(D); s = where(causal(s), s, -inf); return softmax(s, axis=-1) @ v }")
    assert [o for o, _ in out] == [[Replicate()], [Shard(0)], [Shard(1)]]


def test_what_reads_a_dim_otherwise_keeps_it_whole():
    """A max along it, its size as a value, its positions, a slice of it."""
    for src in ("kernel f(x: f32[M, N]) -> f32[N] { return max(x, axis=0) }",
                "kernel f(x: f32[M, N]) -> f32[M, N] { return x / M }",
                "kernel f(x: f32[M, N]) -> f32[M, N] { return x + index(x, 0) }",
                "kernel f(x: f32[M, N]) -> f32[M - 1, N] { return x[1:] }"):
        assert all(all(not isinstance(p, Shard) or p.dim != 0 for p in ins if p) for _, ins in rules(src)), src


def test_a_sum_returned_through_a_nonlinear_op_is_not_partial():
    out = rules("kernel f(x: f32[M, N]) -> f32[M] { return exp(sum(x, axis=-1)) }")
    assert out == [([Replicate()], [Replicate()]), ([Shard(0)], [Shard(0)])]
    out = rules("kernel f(x: f32[M, N]) -> f32[M] { return sum(x, axis=-1) }")
    assert ([Partial()], [Shard(1)]) in out


@pytest.mark.parametrize("case", ["rmsnorm_rows", "column_parallel", "row_parallel", "attention_heads",
                                  "rmsnorm_reduced_dim", "generic_rmsnorm_batch"])
def test_sharded_calls_equal_the_unsharded_run_over_two_processes(case):
    worker = Path(__file__).resolve().parent / "sharded_worker.py"
    out = subprocess.run([sys.executable, str(worker), case], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-4000:]


def test_the_example_block_trains_sharded_over_two_processes():
    """examples/train_block.py --fsdp2: the block of tiledsl.nn modules trains with FSDP2
    (fully_shard) over two gloo processes, each on half the batch, step for step with one
    process on the whole batch; the example checks the parameters equal at the end."""
    example = Path(__file__).resolve().parent.parent / "examples" / "train_block.py"
    out = subprocess.run([sys.executable, str(example), "--fsdp2", "--steps", "2"], capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "the sharded and unsharded parameters agree" and len(lines) == 3, lines
    losses = [(float(line.split()[3]), float(line.split()[7])) for line in lines[:2]]
    assert all(abs(a - b) <= 1e-5 * b for a, b in losses) and losses[1][0] < losses[0][0], losses
    assert "returned a view tensor" not in out.stderr  # FSDP2's warning: the norms return no views


DEFERRED = """
import os, sys, tempfile, torch, tiledsl
fn = tiledsl.compile({src!r})
assert "torch.distributed.tensor" not in sys.modules  # compiling does not import it
import torch.distributed as dist
from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor
with tempfile.TemporaryDirectory() as tmp:
    dist.init_process_group("gloo", init_method="file://" + os.path.join(tmp, "r"), rank=0, world_size=1)
    x, w = torch.randn(6, 33), torch.rand(33) + 0.5
    mesh = DeviceMesh("cpu", [0])
    out = fn(distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(w, mesh, [Replicate()]), 1e-5)
    assert tuple(out.placements) == (Shard(0),), out.placements
    torch.testing.assert_close(out.full_tensor(), fn(x, w, 1e-5))
    dist.destroy_process_group()
print("ok")
"""


GENERIC_RMSNORM = ("kernel f[T: f32 | bf16](x: T[..., D], w: T[D], eps: f32) -> T[..., D] {"
                   " return x * rsqrt(mean(x * x, axis=-1, keepdims=true) + eps) * w }")


@pytest.mark.parametrize("src", [RMSNORM, GENERIC_RMSNORM], ids=["program", "generic"])
def test_rules_of_programs_compiled_before_dtensor_was_imported_are_registered_on_first_use(src):
    """Registering rules imports torch.distributed.tensor (0.6 s): a program compiled before
    it was imported gets its rules when a DTensor first reaches one of its calls. No input
    needs a gradient, so the op's own rules decide (a generic op's, its binding's)."""
    out = subprocess.run([sys.executable, "-c", DEFERRED.format(src=src)], capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0 and out.stdout.split() == ["ok"], out.stderr[-3000:]
