"""Source text and spans.

A `Source` is the text of one .tdsl file with its display name; a `Span` is a
half-open character range in it. Every AST node, IR op and diagnostic carries
a span, so errors can always point at the user's code.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, eq=False)
class Source:
    """The text of one program and the name it is reported under."""

    text: str
    name: str = "<string>"
    _line_starts: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        starts = [0]
        starts.extend(i + 1 for i, ch in enumerate(self.text) if ch == "\n")
        object.__setattr__(self, "_line_starts", tuple(starts))

    def position(self, offset: int) -> tuple[int, int]:
        """1-based (line, column) of a character offset."""
        offset = max(0, min(offset, len(self.text)))
        line = bisect.bisect_right(self._line_starts, offset) - 1
        return line + 1, offset - self._line_starts[line] + 1

    def line_text(self, line: int) -> str:
        """The text of a 1-based line, without its newline."""
        start = self._line_starts[line - 1]
        end = self.text.find("\n", start)
        return self.text[start:] if end < 0 else self.text[start:end]

    def span(self, start: int, end: int) -> Span:
        return Span(self, start, max(start, end))


@dataclass(frozen=True, slots=True)
class Span:
    """A half-open range [start, end) of character offsets in a `Source`."""

    source: Source
    start: int
    end: int

    @property
    def line(self) -> int:
        return self.source.position(self.start)[0]

    @property
    def column(self) -> int:
        return self.source.position(self.start)[1]

    @property
    def text(self) -> str:
        return self.source.text[self.start : self.end]

    def to(self, other: Span | None) -> Span:
        """The smallest span covering both `self` and `other`."""
        if other is None or other.source is not self.source:
            return self
        return Span(self.source, min(self.start, other.start), max(self.end, other.end))

    def location(self) -> str:
        line, col = self.source.position(self.start)
        return f"{self.source.name}:{line}:{col}"

    def __repr__(self) -> str:
        return f"Span({self.location()})"
