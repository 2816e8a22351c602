"""A model of HBM traffic: the bytes a kernel reads and writes, as a polynomial in the dims.

Fused, a kernel reads each input tensor once and writes each output once.
Op by op, every op reads its operands from memory and writes its result.
Scalars passed by value and constants cost nothing. Traffic is a `Poly`, a
map from a monomial (sorted dim symbols) to bytes, printed like
`2·K·M + 2·K·N + 6·M·N` and evaluated at concrete sizes with `evaluate`.
"""

from __future__ import annotations

from collections.abc import Mapping

from tiledsl import ops
from tiledsl.dims import evaluate as dim_size
from tiledsl.ir import KernelOp, Region
from tiledsl.types import TensorType

Poly = dict[tuple[str, ...], int]



def tensor_bytes(t: TensorType) -> Poly:
    coeff = t.dtype.itemsize
    symbols = []
    for d in t.shape:
        if isinstance(d, int):
            coeff *= d
        else:  # a dim expression is one factor
            symbols.append(d if d.isidentifier() else f"({d})")
    return {tuple(sorted(symbols)): coeff}


def add(*polys: Poly) -> Poly:
    out: Poly = {}
    for p in polys:
        for mono, c in p.items():
            out[mono] = out.get(mono, 0) + c
    return {m: c for m, c in out.items() if c}


def sub(a: Poly, b: Poly) -> Poly:
    return add(a, {m: -c for m, c in b.items()})


def evaluate(p: Poly, dims: Mapping[str, int]) -> int:
    total = 0
    for mono, c in p.items():
        term = c
        for s in mono:
            term *= dim_size(s, dims)
        total += term
    return total


def format_poly(p: Poly) -> str:
    if not p:
        return "0"
    terms = sorted(p.items(), key=lambda mc: (-len(mc[0]), mc[0]))
    parts = []
    for mono, c in terms:
        factors = ([str(abs(c))] if abs(c) != 1 or not mono else []) + list(mono)
        parts.append(("- " if c < 0 else "+ ") + "·".join(factors))
    text = " ".join(parts)
    return text[2:] if text.startswith("+ ") else "-" + text[2:]


def kernel_traffic(kernel: KernelOp) -> Poly:
    """Bytes the fused kernel moves: each tensor input read once, each output written once."""
    region = kernel.region
    reads = [tensor_bytes(i.type) for i in region.inputs if not i.scalar]
    writes = [tensor_bytes(t) for t in region.output_types]
    return add(*reads, *writes)


def op_by_op_traffic(region: Region) -> Poly:
    """Bytes the same ops move as separate kernels (each reads operands, writes its result;
    a view moves nothing, its readers read its source)."""
    n_in = len(region.inputs)
    in_memory = {v for v in range(n_in) if not region.inputs[v].scalar}
    total: list[Poly] = []
    for i, rop in enumerate(region.ops):
        if rop.op.kind == "const":
            continue
        in_memory.add(n_in + i)
        if ops.category(rop.op.kind) is ops.Category.LAYOUT:
            continue
        total.extend(tensor_bytes(region.value_type(v)) for v in rop.operands if v in in_memory)
        total.append(tensor_bytes(rop.op.type))
    return add(*total)
