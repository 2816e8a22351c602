"""Running generated kernels in Triton's interpreter, in a process that may also use a GPU.

Triton decides between compiling and interpreting when `@triton.jit` runs,
which for its own standard library (`tl.sum`, `tl.zeros`, ...) is when
`triton.language` is first imported. tiledsl wants both in one process: CUDA
tensors run compiled kernels, CPU tensors the same kernels interpreted. So:

- a generated kernel is wrapped in `InterpretedFunction` for CPU launches;
- during an interpreted launch (and only then), calling a `JITFunction` from
  inside the kernel, which is how the standard library is reached, runs it
  through the interpreter too, with Triton's language patches undone on
  return. Compilation for a GPU never calls
  `JITFunction.__call__` (it inlines callees from their AST), so this does
  not affect GPU launches, and outside `interpreting()` Triton behaves as
  shipped.
- Triton 3.6's interpreter turns a 0-d tensor into a Python int with
  `int(array)` on a one-element 1-d array, which NumPy >= 2.4 refuses, so a
  loop over a runtime bound (`range(0, K, BLOCK_K)`) fails. Inside
  `interpreting()` that conversion uses `.item()` (what later Triton does).
- `tl.sort` is NumPy's sort inside `interpreting()` (the interpreter runs Triton's
  bitonic network element by element).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import triton.language as tl
import triton.runtime.interpreter as _interp
from triton.runtime.interpreter import InterpretedFunction, _patch_lang
from triton.runtime.jit import JITFunction

from .cache import triton_registry_kept

_lock = threading.RLock()
_depth = 0


class _Interpreted(InterpretedFunction):
    """An InterpretedFunction that keeps its rewritten function itself. Triton keeps it in
    the class-level `InterpretedFunction.rewritten_fn`, and registers the JITFunction its
    rewriter makes, which would keep every kernel ever run (and its module) alive."""

    _rewritten: Any = None

    def rewrite(self) -> Any:
        if self._rewritten is None:
            with triton_registry_kept(self.fn):
                self._rewritten = self.rewriter.rewrite_ast()
        return self._rewritten


def interpreted(fn: Any) -> InterpretedFunction:
    """`fn` (a JITFunction, or already interpreted) as an InterpretedFunction."""
    if isinstance(fn, InterpretedFunction):  # TRITON_INTERPRET=1 was set at import
        return fn
    wrapper = fn.__dict__.get("_tiledsl_interpreted")  # kept on the function: released with it
    if wrapper is None:
        wrapper = fn._tiledsl_interpreted = _Interpreted(fn.fn)
    return wrapper


def _sort(x: Any, dim: Any = None, descending: Any = False) -> Any:
    """`tl.sort` by NumPy: the interpreter runs Triton's bitonic network element by element
    (17 s for 17 rows of 100)."""
    dim, descending = getattr(dim, "value", dim), getattr(descending, "value", descending)
    out = np.sort(x.handle.data, axis=-1 if dim is None else dim)
    if descending:
        out = np.flip(out, axis=-1 if dim is None else dim)
    return tl.core.tensor(_interp.TensorHandle(np.ascontiguousarray(out), x.handle.dtype), x.type)


def _call_interpreted(self: JITFunction, *args: Any, **kwargs: Any) -> Any:
    if self is tl.standard.sort:
        return _sort(*args, **kwargs)
    # InterpretedFunction.__call__ would patch triton.language for the callee and
    # never restore it, and a later GPU compile would see the patched builtins.
    scope = _patch_lang(self.fn)
    try:
        return interpreted(self).rewrite()(*args, **kwargs)
    finally:
        scope.restore()


_shipped_call = JITFunction.__call__
_shipped_patch_tensor = _interp._patch_lang_tensor


def _patch_lang_tensor(tensor: Any, scope: Any) -> None:
    _shipped_patch_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))


@contextlib.contextmanager
def interpreting() -> Iterator[None]:
    """Inside: device-function calls of JITFunctions run in the interpreter."""
    global _depth
    # Masked-off lanes are computed too (log(0), 1/0); their values are never stored.
    with _lock, np.errstate(all="ignore"):
        _depth += 1
        JITFunction.__call__ = _call_interpreted
        _interp._patch_lang_tensor = _patch_lang_tensor
        try:
            yield
        finally:
            _depth -= 1
            if _depth == 0:
                JITFunction.__call__ = _shipped_call
                _interp._patch_lang_tensor = _shipped_patch_tensor


def _before_fork() -> None:
    """A fork waits until no other thread is inside `interpreting()`. A launch there runs
    NumPy, whose BLAS (`tl.dot` is `np.matmul`) releases the GIL: a fork in the middle of
    one copies OpenBLAS's state half-updated, and the child's first `tl.dot` hangs."""
    _lock.acquire()


def _after_fork_in_parent() -> None:
    _lock.release()


def _reset_after_fork() -> None:
    """A forked child has only the forking thread, and the forking thread may itself have
    been inside `interpreting()` (its lock held, Triton patched): the child starts outside,
    with a fresh lock."""
    global _lock, _depth
    _lock, _depth = threading.RLock(), 0
    JITFunction.__call__ = _shipped_call
    _interp._patch_lang_tensor = _shipped_patch_tensor


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_reset_after_fork)
