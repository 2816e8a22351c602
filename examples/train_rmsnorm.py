"""Training with tiledsl: a small nn.Module whose RMSNorm is a tiledsl program with a trainable
weight, trained under torch.compile(fullgraph=True). Runs on CPU (Triton's interpreter) or on
a GPU.

    python examples/train_rmsnorm.py
"""

from __future__ import annotations

import torch

import tiledsl

RMSNORM = tiledsl.compile("""
kernel rmsnorm(x: f32[N, D], w: f32[D], eps: f32) -> f32[N, D] {
    r = rsqrt(mean(x * x, axis=-1, keepdims=true) + eps)
    return x * r * w
}
""")


class Block(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = torch.nn.Parameter(torch.ones(dim))
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.proj(RMSNORM(x, self.norm, 1e-6))


def main() -> None:
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = Block(64).to(device)
    compiled = torch.compile(model, backend="aot_eager" if device == "cpu" else "inductor",
                             fullgraph=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randn(37, 64, device=device)
    target = torch.randn(37, 64, device=device)
    for step in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(compiled(x), target)
        loss.backward()
        opt.step()
        print(f"step {step}: loss {loss.item():.4f}, |grad norm.w| {model.norm.grad.norm().item():.4f}")
    print(f"the backward of rmsnorm is {len(RMSNORM.backward.kernels)} kernels:")
    print(RMSNORM.backward.explain())


if __name__ == "__main__":
    main()
