"""Covering sets of combinations: a few rows in which every choice of every variable, or
every pair of choices of every two variables, occurs, for when the full product is too
large to enumerate (`tiledsl check` of a generic kernel with many dtype variables).

A row is a tuple of choice indices, one per variable (variable `i` has `domains[i]`
choices). `pairwise` is IPOG (Lei and Tai's in-parameter-order generation): the rows for
the first variables are extended by one variable at a time, first sideways (each row takes
the choice covering the most uncovered pairs), then downwards (new rows for the pairs
still uncovered). Its work is about rows x choices x variables^2 per variable, so callers
bound the number of pairs (`pair_count`) before asking.
"""

from __future__ import annotations

from collections.abc import Sequence


def pair_count(domains: Sequence[int]) -> int:
    """How many pairs of choices of two different variables there are."""
    total = sum(domains)
    return (total * total - sum(d * d for d in domains)) // 2


def each_choice(domains: Sequence[int]) -> list[tuple[int, ...]]:
    """max(domains) rows in which every choice of every variable occurs (row r takes choice
    r mod n of a variable with n choices)."""
    return [tuple(r % d for d in domains) for r in range(max(domains, default=0))]


def pairwise(domains: Sequence[int]) -> list[tuple[int, ...]]:
    """Rows in which every pair of choices of every two variables occurs (every choice, for
    one variable), deterministically."""
    if any(d < 1 for d in domains):
        raise ValueError("every variable needs at least one choice")
    if len(domains) < 2:
        return each_choice(domains)
    rows: list[list[int | None]] = [[a, b] for a in range(domains[0]) for b in range(domains[1])]
    for i in range(2, len(domains)):
        uncovered = {(j, a, b) for j in range(i) for a in range(domains[j]) for b in range(domains[i])}
        for row in rows:  # sideways: the choice of variable i covering the most new pairs
            best = max(range(domains[i]),
                       key=lambda b: (sum((j, row[j], b) in uncovered for j in range(i)), -b))
            row.append(best)
            uncovered -= {(j, row[j], best) for j in range(i)}
        added: list[list[int | None]] = []
        for j, a, b in sorted(uncovered):  # downwards: a free slot of a new row, or a new row
            for row in added:
                if row[i] == b and row[j] is None:
                    row[j] = a
                    break
            else:
                row = [None] * i + [b]
                row[j] = a
                added.append(row)
        rows += added
    return [tuple(0 if c is None else c for c in row) for row in rows]


def covers_pairs(rows: Sequence[Sequence[int]], domains: Sequence[int]) -> bool:
    """Does every pair of choices of every two variables occur in some row?"""
    seen = {(i, j, row[i], row[j]) for row in rows for i in range(len(domains))
            for j in range(i + 1, len(domains))}
    return len(seen) == pair_count(domains)
