"""tiledsl: a tile DSL that compiles small tensor programs to fused Triton kernels."""

__version__ = "0.1.0"

from tiledsl.api import Kernel, Program, compile  # noqa: E402
from tiledsl.diagnostics import TileDSLError  # noqa: E402

__all__ = ["compile", "Program", "Kernel", "TileDSLError", "__version__"]
