"""`TILEDSL_LOGS`: what tiledsl tells you as it works, as TORCH_LOGS does for torch.

A comma-separated list of channels (or `all`), each a logger on Python's `logging`:

- `fusion` (`tiledsl.fusion`): each compiled program's kernels and the fusions refused;
- `autotune` (`tiledsl.autotune`): each candidate's time and the configuration chosen;
- `cache` (`tiledsl.cache`): kernel modules written to, or reused from, the cache directory;
- `launch` (`tiledsl.launch`): each kernel's launch configuration when a call's sizes
  first plan it.

`TILEDSL_LOGS=fusion,launch python train.py` writes them to stderr at INFO; code can also
configure the loggers itself (`logging.getLogger("tiledsl.fusion").setLevel(...)`).
"""

from __future__ import annotations

import logging
import os
import sys

CHANNELS = ("fusion", "autotune", "cache", "launch")


def logger(channel: str) -> logging.Logger:
    return logging.getLogger(f"tiledsl.{channel}")


def configure(value: str | None = None) -> list[str]:
    """Turn on the channels `value` (default: $TILEDSL_LOGS) names; the channels turned on.
    An unknown name is reported once on stderr, not an error."""
    text = os.environ.get("TILEDSL_LOGS", "") if value is None else value
    names = [n.strip() for n in text.split(",") if n.strip()]
    if "all" in names:
        names = list(CHANNELS)
    unknown = [n for n in names if n not in CHANNELS]
    if unknown:
        print(f"tiledsl: TILEDSL_LOGS names unknown channel(s) {', '.join(unknown)} "
              f"(channels: {', '.join(CHANNELS)}, all)", file=sys.stderr)
    on = [n for n in names if n in CHANNELS]
    for name in on:
        log = logger(name)
        log.setLevel(logging.INFO)
        if not any(getattr(h, "_tiledsl", False) for h in log.handlers):
            handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
            handler._tiledsl = True  # type: ignore[attr-defined]
            log.addHandler(handler)
        log.propagate = False
    return on
