"""The online softmax recurrence, written once: a running max `m` and a running sum `z` of
exp(x - m), rescaled by exp(m_old - m_new) when the max grows (the composable-kernel
recurrence), then finalized into logsumexp (m + log z) or softmax's 1 / z.

The guards keep special rows as torch has them: an infinite max is shifted to 0 before
it is subtracted, so a row that is all -inf gives z = 0 (softmax 0, logsumexp -inf) and
one holding +inf gives z = +inf, never inf - inf; the sum so far is rescaled by 1 where
the max did not move. A NaN makes z NaN. These build Triton source text; the templates
(rows, attention) name the values.
"""

from __future__ import annotations

from .codegen import Code

NEG_INF = '-float("inf")'


def finite(m: str) -> str:
    """The max to subtract: an infinite one (all -inf so far, or +inf) as 0."""
    return f'tl.where(tl.abs({m}) == float("inf"), 0.0, {m})'


def shift(m: str) -> str:
    """softmax's max to subtract: -inf (an empty row) as 0; +inf stays, making the row NaN."""
    return f"tl.where({m} == {NEG_INF}, 0.0, {m})"


def rescale(m: str, m_new: str, m_safe: str, exp: str = "tl.exp") -> str:
    """The factor for the sum so far when the max moves from `m` to `m_new` (`m_safe` being
    `finite(m_new)`): 1 when it did not move (no inf - inf). `exp`: tl.exp2 in base 2."""
    return f"tl.where({m} == {m_new}, 1.0, {exp}({m} - {m_safe}))"


def init(body: Code, name: str) -> tuple[str, str]:
    """The state before a row: m = -inf, z = 0, one per row ([BLOCK_O, 1])."""
    body(f"{name}_m = tl.full([BLOCK_O, 1], {NEG_INF}, tl.float32)")
    body(f"{name}_z = tl.zeros([BLOCK_O, 1], tl.float32)")
    return f"{name}_m", f"{name}_z"


def update(body: Code, m: str, z: str, x: str) -> None:
    """Fold the tile `x` ([BLOCK_O, BLOCK_R], -inf where masked) into the state."""
    body(f"{m}_new = tl.maximum({m}, tl.max({x}, axis=1)[:, None])")
    body(f"{m}_safe = {finite(f'{m}_new')}")
    body(f"{z} = {z} * {rescale(m, f'{m}_new', f'{m}_safe')} + "
         f"tl.sum(tl.exp({x} - {m}_safe), axis=1)[:, None]")
    body(f"{m} = {m}_new")


def logsumexp(m_safe: str, z: str) -> str:
    """The finished logsumexp from `finite(m)` and z: -inf for an empty row (z = 0)."""
    return f"{m_safe} + tl.log({z})"


def positive_inverse(z: str) -> str:
    """1 / z, and 0 for a row that is all -inf (z == 0)."""
    return f"tl.where({z} > 0.0, 1.0 / {z}, 0.0)"


def nan_row(m: str, z: str) -> str:
    """A row whose softmax is NaN, as torch's: a NaN in the row makes z NaN, a +inf makes
    the max +inf."""
    return f'({m} == float("inf")) | ({z} != {z})'
