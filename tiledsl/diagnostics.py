"""User-facing errors.

Every error a user can see is a `TileDSLError`. Each kind of message is its
own subclass with a `template`; the message is part of the interface and is
tested as text. `str(err)` renders like a C compiler:

    attention.tdsl:4:9: error: unknown function 'sofmax'; did you mean 'softmax'?
        p = sofmax(s, axis=-1)
            ^~~~~~

followed by notes that point at related spans (the first definition, the
other operand). Control characters in messages are escaped so a diagnostic
can never rewrite the user's terminal.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from dataclasses import dataclass

from tiledsl.source import Span


def escape(text: str) -> str:
    """Escape control and non-printable characters for display."""
    out = []
    for ch in text:
        if ch == "\\":
            out.append("\\\\")
        elif ch.isprintable() or ch == " ":
            out.append(ch)
        else:
            out.append(ch.encode("unicode_escape").decode("ascii"))
    return "".join(out)


def suggest(name: str, candidates: Iterable[str]) -> str | None:
    """The closest candidate to `name`, if one is close enough to be a typo."""
    matches = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return matches[0] if matches else None


def did_you_mean(name: str, candidates: Iterable[str]) -> str:
    match = suggest(name, candidates)
    return f"; did you mean '{match}'?" if match else ""


@dataclass(frozen=True, slots=True)
class Note:
    """A secondary message attached to an error, optionally with a location."""

    message: str
    span: Span | None = None


class TileDSLError(Exception):
    """Base of every user-facing error.

    Attributes: `message` (the one-line text), `span` (where, or None),
    `notes`, and `filename`, `line`, `column` (1-based; 0 when unknown).
    """

    template = "{message}"

    def __init__(
        self, span: Span | None = None, notes: Iterable[Note] = (), **fields: object
    ) -> None:
        self.span = span
        self.notes = tuple(notes)
        self.fields = fields
        self.message = escape(self.template.format(**fields))
        super().__init__(self.message)

    @property
    def filename(self) -> str:
        return self.span.source.name if self.span else "<input>"

    @property
    def line(self) -> int:
        return self.span.line if self.span else 0

    @property
    def column(self) -> int:
        return self.span.column if self.span else 0

    def __str__(self) -> str:
        parts = [_render("error", self.message, self.span)]
        parts.extend(_render("note", note.message, note.span) for note in self.notes)
        return "\n".join(parts)


_MAX_SHOWN = 100  # longest source excerpt shown under a diagnostic


def _render(severity: str, message: str, span: Span | None) -> str:
    if span is None:
        return f"{severity}: {message}"
    head = f"{escape(span.location())}: {severity}: {message}"
    line, col = span.line, span.column
    text = span.source.line_text(line)
    # Underline only the part of the span that lies on its first line.
    end_line, end_col = span.source.position(max(span.start, span.end - 1))
    width = (end_col - col + 1) if end_line == line and span.end > span.start else 1
    width = max(1, min(width, len(text) - col + 1))
    first = col - 1
    if len(text) > _MAX_SHOWN:  # show a window of a very long line around the caret
        lo = max(0, first - _MAX_SHOWN // 2)
        hi = min(len(text), lo + _MAX_SHOWN)
        text = ("..." if lo else "") + text[lo:hi] + ("..." if hi < len(text) else "")
        first = first - lo + (3 if lo else 0)
        width = min(width, len(text) - first)
    shown = escape(text)
    prefix = escape(text[:first])
    marker = " " * len(prefix) + "^" + "~" * (width - 1)
    return f"{head}\n    {shown}\n    {marker}"


# --- syntax -----------------------------------------------------------------


class ParseError(TileDSLError):
    """Base of errors raised while reading the program text."""


class EmptySourceError(ParseError):
    template = "the program is empty: expected at least one 'kernel'"


class UnexpectedCharacterError(ParseError):
    template = "unexpected character '{char}'{expected}"


class UnexpectedTokenError(ParseError):
    template = "unexpected {token}{expected}"


class UnexpectedEndError(ParseError):
    template = "unexpected end of file{expected}"


class LimitError(TileDSLError):
    template = "{what} exceeds the limit of {limit}"


class BidiCodepointError(ParseError):
    """A Unicode bidi override or isolate in the text (Trojan Source, CVE-2021-42574):
    rustc's `text_direction_codepoint_in_comment`/`_in_literal`, refused."""

    template = "unicode codepoint changing visible direction of text present in {where}: {codepoint}"


# --- names and calls ----------------------------------------------------------


class UndefinedNameError(TileDSLError):
    template = "undefined name '{name}'{hint}"


class UnknownFunctionError(TileDSLError):
    template = "unknown function '{name}'{hint}"


class NotCallableError(TileDSLError):
    template = "'{name}' is a {what}, not a function"


class ArityError(TileDSLError):
    template = "'{name}' takes {expected}, got {got}"


class KeywordError(TileDSLError):
    template = "{message}"


class UnknownAttributeError(TileDSLError):
    template = "unknown attribute '.{name}': only '.T' (swap the last two dims) is supported"


class DuplicateParameterError(TileDSLError):
    template = "parameter '{name}' is declared twice"


class DuplicateKernelError(TileDSLError):
    template = "kernel '{name}' is defined twice"


class LiteralNameError(TileDSLError):
    template = "'{name}' cannot name a {what}: in an expression it is {meaning}"


class NameConflictError(TileDSLError):
    template = "'{name}' names both a parameter and a dimension"


class UnknownDTypeError(TileDSLError):
    template = "unknown dtype '{name}'{hint}"


class ChainedComparisonError(TileDSLError):
    template = "comparisons cannot be chained; write '(a {op1} b) & (b {op2} c)'"


class ReturnError(TileDSLError):
    template = "{message}"


class UnpackError(TileDSLError):
    template = "{message}"


class ConstantExpected(TileDSLError):
    template = "{what} must be {expected}"


class DropoutProbabilityError(TileDSLError):
    """torch's F.dropout refusal, word for word."""

    template = "dropout probability has to be between 0 and 1, but got {value}"


# --- types and shapes ---------------------------------------------------------


class DTypeError(TileDSLError):
    template = "{message}"


class BroadcastError(TileDSLError):
    template = "shapes {lhs} and {rhs} cannot be broadcast: dim {dim} is {a} in one and {b} in the other"


class MatmulShapeError(TileDSLError):
    template = "{message}"


class AxisError(TileDSLError):
    template = "axis {axis} is out of range for a value of rank {rank} (valid: {lo} to {hi})"


class DuplicateAxisError(TileDSLError):
    template = "axis {axis} appears twice in the axes of '{func}'"


class IndexingError(TileDSLError):
    """A subscript, gather, concat or reshape that cannot be built."""

    template = "{message}"


class RankError(TileDSLError):
    template = "{message}"


class ReturnTypeError(TileDSLError):
    template = "{message}"


class TileHintError(TileDSLError):
    template = "{message}"


# --- API and call-time ---------------------------------------------------------


class EmptyReductionError(TileDSLError):
    """A reduction with no value over an empty axis (max, min) met one at a call."""

    template = "{kind} over an empty axis ({axis} at this call): {kind} has no identity (torch raises too)"


class TileSizeError(TileDSLError):
    """A call's sizes need a tile larger than Triton can hold (a head dim past 65536)."""

    template = "{message}"


class KernelSelectionError(TileDSLError):
    template = "{message}"


class ArgumentError(TileDSLError):
    """A bad argument at call time; the span points at the parameter's declaration."""

    template = "{message}"


class OptionError(TileDSLError):
    template = "{message}"


class CacheError(TileDSLError):
    """The kernel cache directory cannot be used safely (or at all)."""


class GradientError(TileDSLError):
    """A program tiledsl cannot differentiate; the span points at the op in the way."""

    template = "{message}"


class InternalError(TileDSLError):
    """A compiler bug surfaced as a located error rather than a traceback."""

    template = "internal compiler error: {message}"
