"""Addressing in a row program, as the `Layout` part of `rows.RowProgram`: each dim's
index at the tile, a tensor's pointer and mask there (`access`), the loads of the inputs
and the stores of the outputs, and the mask of the tile at positions `r` along the row.

A value's layout (`RowPlan.layouts`) names the dims of the iteration space each of its
tensor's dims runs along: a kept dim's index is `j<dim>` (per row, `[:, None]`), a row
axis's `r` (or `k<axis>` with several row axes), and a selection's j-th element is lane j
of its per-row tile. Where a tensor has every row dim in order, a per-call flag picks
the flat row index times a stride (`flat_offset`).
"""

from __future__ import annotations

from .base import decompose
from .codegen import TensorRef
from .expr import Val


class Layout:
    """Addressing (a mixin of `rows.RowProgram`, whose plan, signature and emitter it uses)."""

    def index(self, dim: int | None, selected: bool = False) -> str | None:
        if dim is None or self.plan.shape[dim] == 1:
            return None
        if dim not in self.plan.axes:
            return f"j{dim}[:, None]"
        if selected:  # the j-th selected element is lane j of its per-row tile
            return f"{self.lanes}[None, :]"
        return "r[None, :]" if len(self.plan.axes) == 1 else f"k{dim}[None, :]"

    def access(self, ref: TensorRef, v: int) -> tuple[str | None, str | None]:
        """(pointer, mask) of a value's tensor at the tile, or (None, None) for one element."""
        layout = self.layouts[v]
        offset = self.flat_offset(ref, layout) if v not in self.plan.selected else None
        offset = offset or ref.offset([self.index(d, v in self.plan.selected) for d in layout])
        if v in self.plan.selected:  # (k = 1: lane 0 only)
            lanes = "" if self.lanes in offset else f" + {self.lanes}[None, :] * 0"
            return f"{ref.ptr} + {offset}{lanes}", self.chosen_mask(v)
        if offset == "0":
            return None, None
        axes = self.plan.axes
        rows = any(self.index(d) for d in layout if d is not None and d not in axes)
        cols = any(self.index(d) for d in layout if d in axes)
        mask = {(True, True): "tmask", (True, False): "omask[:, None]",
                (False, True): "rmask"}[(rows, cols)]
        return f"{ref.ptr} + {offset}", mask

    def put_at(self, j: int, v: int, vals) -> tuple[str, str]:
        """(pointer, mask) of a put's output at the positions it writes the selected tile's
        elements (fuse-rows admits a put at a sort's positions only: `legality._row_put`)."""
        src, *indices = self.operands(v)
        at = [self.em.tensor(vals[i]).text if self.region.value_type(i).shape[k] != 1 else None
              for k, i in enumerate(indices)]
        return f"{self.outs[j].ptr} + {self.outs[j].offset(at)}", self.chosen_mask(src)

    def flat_offset(self, ref: TensorRef, layout) -> str | None:
        """A tensor's offset whose rows may be the flat row index times a stride: where
        it has every row dim, in their order, the per-call flag (`RowsFlat`) picks
        `o * stride` or the dims' indices times their strides (Triton compiles one). None
        where it cannot (a broadcast row dim, rows in groups, one row dim only)."""
        rows = [d for d in self.kept if self.plan.shape[d] != 1]
        axes = tuple(a for d in rows for a, e in enumerate(layout) if e == d)
        if self.group > 1 or self.split or len(rows) < 2 or len(axes) != len(rows) \
                or list(axes) != sorted(axes) or any(ref.strides[a] is None for a in axes):
            return None
        flag = self.sig.rows_flat(ref.role, ref.index, axes)
        by_dims = ref.offset([self.index(d) if d in rows else None for d in layout])
        cols = ref.offset([self.index(d) if d is not None and d not in rows else None for d in layout])
        row = f"(o[:, None] * {ref.strides[axes[-1]]} if {flag} else {by_dims})"
        return row if cols == "0" else f"{row} + {cols}"

    def load(self, i: int) -> Val:
        t = self.region.inputs[i].type
        if i in self.scalars:
            return self.em.scalar(self.scalars[i], t)
        if i in self.reused:
            return self.reused[i]
        ptr, mask = self.access(self.refs[i], i)
        if ptr is None:
            ptr, mask = self.refs[i].ptr, None
        return self.em.load_at(ptr, mask, t)

    def store(self, vals: dict[int, Val], full: bool, skip: frozenset[int] = frozenset()) -> None:
        for j, v in enumerate(self.region.outputs):
            if self.full(v) != full or v in skip or v in self.plan.tail:
                continue
            ptr, mask = self.access(self.outs[j], v) if self.op(v).kind != "put" else self.put_at(j, v, vals)
            if ptr is None:  # a single element (no kept dims): row 0 writes it
                ptr = f"{self.outs[j].ptr} + o[:, None] * 0"
            if not full and v not in self.plan.selected:
                mask = "omask[:, None]"
            if self.plan.across is not None and self.plan.across not in self.layouts[v]:  # one row stores
                c = self.plan.across
                mask = f"{mask or 'omask[:, None]'} & (j{c} == 0)[:, None]"
                if "[:, None]" not in ptr:  # a pointer of no row's (the value varies along the row only)
                    ptr = f"{ptr} + j{c}[:, None] * 0"
            text = self.em.store_value(vals[v], self.region.value_type(v))
            self.body(f"tl.store({ptr}, {text}, mask={mask})")

    def row_invariant(self) -> list[int]:
        """The tensor inputs read along the row alone (a norm's weight), the same for every
        row of the tile."""
        return [i for i, ref in self.refs.items() if i not in self.scalars and self.used(i)
                and self.access(ref, i)[1] == "rmask"]

    def tile_mask(self) -> None:
        """The mask of the tile at positions `r`, and with several row axes, `r` split into
        an index per axis."""
        self.row_mask()
        self.body("tmask = omask[:, None] & rmask")

    def row_mask(self) -> None:
        """`rmask`, the mask of positions `r` along the row (`tile_mask` without the rows')."""
        shape, axes = self.plan.shape, self.plan.axes
        if len(axes) > 1:
            names = [None if shape[a] == 1 else f"k{a}" for a in axes]
            decompose(self.body, "r", [shape[a] for a in axes], names, self.sig.size, "kq")
        self.body("if EVEN_R:")
        with self.body.indent():
            self.body("rmask = tl.full([1, BLOCK_R], 1, tl.int1)")
        self.body("else:")
        with self.body.indent():
            self.body(f"rmask = (r < {self.length})[None, :]")
