"""tiledsl: a tile DSL that compiles small tensor programs to fused Triton kernels."""

__version__ = "0.1.0"

from tiledsl.api import Kernel, Program, compile  # noqa: E402
from tiledsl.diagnostics import TileDSLError  # noqa: E402
from tiledsl.logs import configure as _configure_logs  # noqa: E402

_configure_logs()  # TILEDSL_LOGS=fusion,autotune,cache,launch (tiledsl/logs.py)

__all__ = ["compile", "Program", "Kernel", "TileDSLError", "__version__"]
