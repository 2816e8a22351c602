"""Scans along a row program's row (cumsum, cumprod, cummax, cummin, logcumsumexp,
linear_scan: `Scan` in tiledsl/ops), as the `Scans` part of `rows.RowProgram`.

A scan is computed inside the loops from its operands, like softmax (`in_loop`): a chunk's
tile is scanned by `tl.associative_scan` with the scan's `combine` (a jit helper,
`combine_helper`) or by Triton's own scan, and combined with the partials of the chunks
before it, carried per row (`start_scans`); a loop computing reverse scans walks the row
from its end (`runs_backward`). The partials a scan holds per element bound the row a
program holds in registers (`scan_words`, `rows.one_pass_limit`).
"""

from __future__ import annotations

from tiledsl import ops
from tiledsl.ops import Scan
from tiledsl.plans import RowPlan
from tiledsl.types import Compute, DType

from .expr import HELPERS, TRITON_TYPE, Val
from .renderings import SCANS, Scanning
from .row_reduce import F32


def in_loop(kind: str) -> bool:
    """Is a row op computed inside the loops from its operands (softmax, a scan), not
    accumulated in a phase of its own?"""
    return kind == "softmax" or ops.OPS[kind].scan is not None


def combine_helper(kind: str, scan: Scanning) -> str:
    """A scan's `combine` as the jit function tl.associative_scan and tl.reduce call."""
    n = len(scan.combine)
    a, b = [f"a{i}" for i in range(n)], [f"b{i}" for i in range(n)]
    parts = ", ".join(c.format(**dict(zip(a + b, a + b, strict=True))) for c in scan.combine)
    return f"@triton.jit\ndef {kind}_combine({', '.join(a + b)}):\n    return {parts}\n\n"


for _kind, _scan in SCANS.items():
    HELPERS[f"{_kind}_combine"] = combine_helper(_kind, _scan)


class Scans:
    """Scans (a mixin of `rows.RowProgram`, whose plan and emitter it uses)."""

    def scanned(self, v: int) -> bool:
        """Is `v` a scan along the row?"""
        return self.is_row_op(v) and ops.OPS[self.op(v).kind].scan is not None

    def scan(self, v: int, xs: list[Val]) -> Val:
        """A scan along the row (`Scan` in tiledsl/ops): the chunk's tile scanned by
        `tl.associative_scan` (or Triton's own scan), each partial then combined with the
        chunks before it (`carries[v]`, per row, when the row takes several chunks), which
        then become the chunk's last partials (no tl.reduce: its combine must commute).
        f32 cumsum and cumprod accumulate in f64, like a sum."""
        em, cat, kind = self.em, self.reduce_cat(v), self.op(v).kind
        scan = SCANS[kind]
        lifted = self.lifted(scan, xs, cat)
        source = self.plan.source(v)
        selected = source in self.plan.selected  # along a selection's k (forward only)
        if scan.start is not None:
            last = f"{self.length} - 1" if self.op(v).attr("reverse") else "0"
            first = f"({self.lanes} == 0)[None, :]" if selected else f"(r == {last})[None, :]"
            lifted = self.started(scan, lifted, cat, first)
        mask = self.chosen_mask(source) if selected else "tmask"
        parts = []
        for x, identity in zip(lifted, scan.identity, strict=True):
            if self.wide(v):
                x = em.assign(f"{em.tensor(x).text}.to(tl.float64)", F32)
            parts.append(self.masked(x, self.identity(identity, cat), mask))
        names = [em.fresh("cs") for _ in parts]
        reverse = ", reverse=True" if self.op(v).attr("reverse") else ""
        if scan.builtin is not None:
            self.body(f"{names[0]} = {scan.builtin}({parts[0]}, axis=1{reverse})")
        else:
            em.helpers.add(f"{kind}_combine")
            self.body(f"{', '.join(names)} = tl.associative_scan({self.packed(parts)}, 1, "
                      f"{kind}_combine{reverse})")
        carry = self.carries.get(v)
        if carry is not None:
            self.body(f"{', '.join(names)} = {', '.join(self.combined(scan, carry, names))}")
            if scan.collapse is not None:
                total = scan.collapse.format(x=parts[0])
                self.body(f"{carry[0]} = {self.combined(scan, carry, [f'{total}[:, None]'])[0]}")
            else:  # the chunk's last partial (its first in reverse) combines it all
                last = "0" if self.op(v).attr("reverse") else "BLOCK_R - 1"
                self.body(", ".join(carry) + " = " + ", ".join(
                    f"tl.sum(tl.where(r_base[None, :] == {last}, {n}, 0), axis=1)[:, None]" for n in names))
        return self.finalized_scan(scan, [Val(n, cat) for n in names], cat, self.wide(v))

    def lifted(self, scan: Scan, xs: list[Val], cat: Compute) -> list[Val]:
        """An element's partials from its operands (in the scan's compute type)."""
        xs = [self.em.convert(x, cat) for x in xs]
        if scan.lift is None:
            return xs
        fields = {f"x{i}": self.em.tensor(x).text for i, x in enumerate(xs)}
        return [self.em.assign(p.format(**fields), cat) for p in scan.lift]

    def started(self, scan: Scan, parts: list[Val], cat: Compute, first: str | None = None) -> list[Val]:
        """The partials of the row's first element (where `first` holds; every element when
        None) combined with the state the row starts from (`Scan.start`)."""
        start = [self.identity(s, cat) for s in scan.start]
        texts = [self.em.tensor(p).text for p in parts]
        combined = self.combined(scan, start, texts)
        if first is None:
            return [self.em.assign(c, cat) for c in combined]
        return [self.em.assign(f"tl.where({first}, {c}, {t})", cat)
                for c, t in zip(combined, texts, strict=True)]

    def finalized_scan(self, scan: Scan, parts: list[Val], cat: Compute, wide: bool = False) -> Val:
        narrow = ".to(tl.float32)" if wide else ""
        text = scan.finalize.format(**{f"p{i}": f"{p.text}{narrow}" for i, p in enumerate(parts)})
        return self.em.assign(text, cat)

    @staticmethod
    def packed(parts: list[str]) -> str:
        return parts[0] if len(parts) == 1 else f"({', '.join(parts)})"

    @staticmethod
    def combined(scan: Scan, left: list[str], right: list[str]) -> list[str]:
        """`scan`'s combination of the partials `left` (the elements before) and `right`."""
        fields = {f"a{i}": a for i, a in enumerate(left)} | {f"b{i}": b for i, b in enumerate(right)}
        return [c.format(**fields) for c in scan.combine]

    def start_scans(self, need: set[int]) -> None:
        """Before a loop over the row: carries that change nothing for every scan the loop
        computes."""
        self.carries = {}
        for v in sorted(need):
            if self.scanned(v):
                scan, cat = SCANS[self.op(v).kind], self.reduce_cat(v)
                compute = "tl.float64" if self.wide(v) else TRITON_TYPE[cat]
                names = self.carries[v] = [self.em.fresh("carry") for _ in scan.identity]
                for name, identity in zip(names, scan.identity, strict=True):
                    self.body(f"{name} = tl.full([BLOCK_O, 1], {self.identity(identity, cat)}, {compute})")

    def runs_backward(self, need: set[int]) -> bool:
        """Does a loop computing `need` run from the end of the row (its scans are reverse;
        fuse-rows keeps a row program's scans to one direction)?"""
        return any(self.scanned(v) and self.op(v).attr("reverse") for v in need)


def scan_words(plan: RowPlan, region) -> list[int]:
    """The 32-bit words of partials each scan of a row program holds per element, and one
    more where its combine computes an exponential (logcumsumexp's rescaling: at 16k f32
    elements, two words, it spilled 40 bytes under Triton 3.9's ptxas options)."""
    n_in = len(region.inputs)
    out = []
    for v in plan.reducing:
        op = region.ops[v - n_in].op
        if op.kind in SCANS:
            scan = SCANS[op.kind]
            out.append(len(scan.identity) * (2 if scan.wide and op.dtype is DType.F32 else 1)
                       + any("exp" in c for c in scan.combine))
    return out
