"""Train a small transformer block built from tiledsl.nn modules under torch.compile.

Pre-norm attention with rotary embeddings and a causal mask (written as a score
modification), then a gated MLP, a vocabulary projection and cross-entropy: every norm,
the attention, the rotary embedding, the MLP and the loss are tiledsl programs. The same
block built from torch's modules starts from the same weights; both train for a few steps
with SGD and their losses are printed side by side.

With --fsdp2 the tiledsl block trains sharded instead: two processes over gloo, each with
its half of the batch and its half of every parameter (FSDP2's `fully_shard`), beside one
process training the same block on the whole batch; the losses are printed side by side
and the parameters of both runs are checked equal at the end.

    python examples/train_block.py            # CPU (Triton's interpreter) or a GPU
    python examples/train_block.py --fsdp2    # two CPU processes over gloo
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import tempfile

import torch
import torch.nn.functional as F
from torch import nn

import tiledsl.nn as tnn

VOCAB, DIM, HEADS, HIDDEN, SEQ, BATCH = 64, 32, 2, 48, 16, 2


def rotary_tables(batch: int, seq: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2) / head_dim))
    angles = torch.arange(seq)[:, None] * inv[None, :]
    emb = torch.cat((angles, angles), dim=-1).expand(batch, seq, head_dim)
    return emb.cos(), emb.sin()


class Block(nn.Module):
    """A LLaMA-style block; `lib` picks tiledsl.nn's modules or torch's."""

    def __init__(self, lib: str) -> None:
        super().__init__()
        self.lib = lib
        norm = tnn.RMSNorm if lib == "tiledsl" else nn.RMSNorm
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attn_norm = norm(DIM, eps=1e-6)
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)
        self.mlp_norm = norm(DIM, eps=1e-6)
        self.mlp = tnn.SwiGLU(DIM, HIDDEN) if lib == "tiledsl" else TorchSwiGLU(DIM, HIDDEN)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        if lib == "tiledsl":
            self.attention = tnn.Attention("where(index(s, -1) <= index(s, -2), s, -inf)")
            self.loss = tnn.CrossEntropyLoss(ignore_index=-100)
        else:
            self.loss = nn.CrossEntropyLoss(ignore_index=-100)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        x = self.embed(tokens)
        q, k, v = self.qkv(self.attn_norm(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        if self.lib == "tiledsl":
            q, k = tnn.apply_rotary(q, k, cos, sin)
            a = self.attention(q, k, v)
        else:
            q, k = (y * cos[:, None] + rotate_half(y) * sin[:, None] for y in (q, k))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, t, DIM))
        x = x + self.mlp(self.mlp_norm(x))
        return self.loss(self.head(x).view(b * t, VOCAB), labels.reshape(b * t))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    return torch.cat((-x[..., x.shape[-1] // 2:], x[..., : x.shape[-1] // 2]), dim=-1)


class TorchSwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def main(steps: int = 4) -> list[tuple[float, float]]:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ours = Block("tiledsl").to(device)
    theirs = Block("torch").to(device)
    theirs.load_state_dict(copy.deepcopy(ours.state_dict()))  # the same keys, the same weights
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g).to(device)
    inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
    labels[0, :3] = -100  # ignored positions
    cos, sin = (t.to(device) for t in rotary_tables(BATCH, SEQ, DIM // HEADS))
    compiled = torch.compile(ours, fullgraph=True, dynamic=True)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ours, theirs)]
    losses = []
    for step in range(steps):
        pair = []
        for model, opt in zip((compiled, theirs), opts, strict=True):
            opt.zero_grad()
            loss = model(inputs, labels, cos, sin)
            loss.backward()
            opt.step()
            pair.append(loss.item())
        losses.append((pair[0], pair[1]))
        print(f"step {step}: loss {pair[0]:.5f} (tiledsl.nn, torch.compile)  {pair[1]:.5f} (torch)")
    assert all(math.isfinite(a) for a, _ in losses) and losses[-1][0] < losses[0][0]
    return losses


def _fsdp2_rank(rank: int, init: str, steps: int) -> None:
    """One of the two processes of `sharded`: FSDP2 over gloo on its half of the batch; rank
    0 also trains the unsharded block on the whole batch (its loss is the mean of the two
    halves', its gradients their average) and compares."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DeviceMesh

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        single, model = Block("tiledsl"), Block("tiledsl")
        model.load_state_dict(single.state_dict())
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, VOCAB, (2 * BATCH, SEQ + 1), generator=g)
        inputs, labels = tokens[:, :-1], tokens[:, 1:].clone()
        labels[0, :3] = -100
        cos, sin = rotary_tables(2 * BATCH, SEQ, DIM // HEADS)
        half = slice(rank * BATCH, (rank + 1) * BATCH)
        mesh = DeviceMesh("cpu", [0, 1])
        for module in (model.attn_norm, model.mlp, model.mlp_norm, model):
            fully_shard(module, mesh=mesh)
        opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (model, single)]
        for step in range(steps):
            opts[0].zero_grad()
            # each half's mean loss over its targets not ignored, weighted so that the
            # gradients FSDP2 averages are the whole batch's
            counted = (labels != -100).sum()
            mine = (labels[half] != -100).sum()
            loss = model(inputs[half], labels[half], cos[half], sin[half]) * (2 * mine / counted)
            loss.backward()
            opts[0].step()
            total = loss.detach().clone()
            dist.all_reduce(total)
            opts[1].zero_grad()
            ref = single(inputs, labels, cos, sin)
            ref.backward()
            opts[1].step()
            if rank == 0:
                print(f"step {step}: loss {total.item() / 2:.6f} (2 processes, FSDP2)  {ref.item():.6f} "
                      "(1 process)", flush=True)
        for (name, p), (_, q) in zip(model.named_parameters(), single.named_parameters(), strict=True):
            torch.testing.assert_close(p.full_tensor().detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)
        dist.barrier()
        if rank == 0:
            print("the sharded and unsharded parameters agree", flush=True)
    finally:
        dist.destroy_process_group()


def sharded(steps: int = 3) -> None:
    """Train the tiledsl block with FSDP2 over two CPU processes (gloo) beside one process."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init = "file://" + os.path.join(tmp, "rendezvous")
        mp.start_processes(_fsdp2_rank, args=(init, steps), nprocs=2, start_method="fork")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fsdp2", action="store_true", help="train sharded over two gloo processes")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    sharded(args.steps) if args.fsdp2 else main(args.steps)
