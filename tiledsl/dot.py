"""Graphviz DOT text of the fusion graph: one `cluster_` per kernel.

Inside a cluster, the kernel's region ops are nodes labelled with op, dtype
and shape; edges follow operands, within kernels and across them. Parameters
and the return are ellipses; views (transpose) are dashed boxes. Labels are
escaped, so any name is safe to render.
"""

from __future__ import annotations

from tiledsl.ir import Graph, KernelOp, Op


def quote(text: str) -> str:
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def to_dot(graph: Graph) -> str:
    out = [f"digraph {quote(graph.name)} {{",
           "  rankdir=TB;",
           '  node [shape=box, fontname="monospace", fontsize=10];']
    # (node, result) -> DOT node id that produces it
    producer: dict[tuple[int, int], str] = {}
    edges: list[tuple[str, str]] = []
    for node in graph.topo_order():
        op = graph.op(node)
        operands = graph.operand_edges(node)
        if isinstance(op, KernelOp):
            region = op.region
            n_in = len(region.inputs)
            ids = [f"n{node}_{i}" for i in range(len(region.ops))]
            out.append(f"  subgraph cluster_{op.name} {{")
            out.append(f"    label={quote(f'{op.name} ({op.template})')};")
            out.append('    style=rounded; color="#4a6fa5";')
            for i, rop in enumerate(region.ops):
                label = f"{rop.op.kind}\n{rop.op.type}"
                if rop.op.kind == "const":
                    label = f"const {rop.op.attr('value')}"
                out.append(f"    {ids[i]} [label={quote(label)}];")
                for v in rop.operands:
                    if v >= n_in:
                        edges.append((ids[v - n_in], ids[i]))
                    else:
                        edges.append((producer[operands[v]], ids[i]))
            if not region.ops:  # a copy kernel
                copy = f"n{node}_copy"
                out.append(f"    {copy} [label={quote('copy')}];")
                edges.append((producer[operands[0]], copy))
                ids = [copy]
            out.append("  }")
            for r, v in enumerate(region.outputs):
                producer[(node, r)] = ids[v - n_in] if v >= n_in else ids[0]
        elif isinstance(op, Op):
            ident = f"n{node}"
            if op.kind == "param":
                label, shape = f"{op.attr('name')}\n{op.type}", ", shape=ellipse"
            elif op.kind == "return":
                label, shape = "return", ", shape=ellipse"
            else:
                label = f"{op.kind}\n{op.type}"
                shape = ", style=dashed" if op.kind == "transpose" else ""
            out.append(f"  {ident} [label={quote(label)}{shape}];")
            producer[(node, 0)] = ident
            edges.extend((producer[e], ident) for e in operands)
    out.extend(f"  {a} -> {b};" for a, b in edges)
    out.append("}")
    return "\n".join(out) + "\n"
