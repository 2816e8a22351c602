"""Drop-in modules for model code: `RMSNorm`, `LayerNorm`, `SwiGLU`, `CrossEntropyLoss`,
`apply_rotary` and `Attention`, each computed by a generic program shipped in the package
(`tiledsl/library/*.tdsl`, readable and explainable like any user program: `program(name)`).

The modules take the constructor arguments of the torch modules they replace and have the
same parameters and `state_dict` keys, so a model swaps them in (or loads a checkpoint)
unchanged. Each call runs the specialization its arguments bind (dtype and rank), through
one PyTorch operator per program: autograd, torch.compile, torch.export and make_fx see it.

Each module's forward is one call of a function here (`rms_norm`, `layer_norm`, `swiglu`,
`cross_entropy`, `apply_rotary`, `attention`), as torch's modules call
torch.nn.functional. Those functions take part in torch's `__torch_function__` protocol as
torch.nn.functional's do, so `torch.fx.symbolic_trace` records each call as one node (a
module holding these is traced; the node runs the function on real tensors) instead of
running the function on its proxies.
"""

from __future__ import annotations

import functools
import math
import numbers
import weakref
from collections.abc import Callable
from importlib import resources
from typing import Any, TypeVar

import torch
from torch import nn
from torch.overrides import handle_torch_function, has_torch_function

from tiledsl import diagnostics as diag

__all__ = ["RMSNorm", "LayerNorm", "SwiGLU", "CrossEntropyLoss", "apply_rotary", "Attention", "program",
           "rms_norm", "layer_norm", "swiglu", "cross_entropy", "attention", "TargetError"]

_FILES = {"rms_norm": "norms", "rms_norm_unscaled": "norms", "layer_norm": "norms",
          "layer_norm_scaled": "norms", "layer_norm_unscaled": "norms", "swiglu": "mlp",
          "swiglu_biased": "mlp", "rotary": "rotary", "cross_entropy": "loss",
          "cross_entropy_smoothed": "loss"}


def _compile(name: str) -> Any:
    from tiledsl.api import compile_text

    file = f"library/{_FILES[name]}.tdsl"
    return compile_text(resources.files("tiledsl").joinpath(file).read_text(), f"tiledsl/{file}", name)


# compiled (and their ops registered) on import: a generic program compiles no binding until
# called, and code torch.compile traces then finds every op already there
_PROGRAMS = {name: _compile(name) for name in _FILES}


def program(name: str) -> Any:
    """The library's compiled program `name`, a generic one (`tiledsl.api.Generic`):
    `program("rms_norm").specialize(T="bf16", batch=1)` is a whole program, to explain,
    inspect or call."""
    fn = _PROGRAMS.get(name)
    if fn is None:
        raise diag.OptionError(message=(
            f"tiledsl.nn.program: no library program '{name}'{diag.did_you_mean(name, _FILES)} "
            f"(programs: {', '.join(_FILES)})"))
    return fn


_Fn = TypeVar("_Fn", bound=Callable[..., Any])


def _overridable(fn: _Fn) -> _Fn:
    """`fn` with torch.nn.functional's `__torch_function__` protocol: a call given an
    argument that overrides it (torch.fx's Proxy under `symbolic_trace`), or made under a
    TorchFunctionMode, is handed to that. `symbolic_trace` then records the call as one node
    whose target is this function, where it would otherwise run `fn` on its proxies (which
    have no dtype to read nor data for a kernel)."""

    @functools.wraps(fn)
    def overridable(*args: Any, **kwargs: Any) -> Any:
        relevant = (*args, *kwargs.values())
        if has_torch_function(relevant):
            return handle_torch_function(overridable, relevant, *args, **kwargs)
        return fn(*args, **kwargs)

    return overridable  # type: ignore[return-value]


def _shape(normalized_shape: int | tuple[int, ...] | list[int] | torch.Size) -> tuple[int, ...]:
    if isinstance(normalized_shape, numbers.Integral):
        return (int(normalized_shape),)
    return tuple(int(d) for d in normalized_shape)


def _normalize(name: str, x: torch.Tensor, shape: tuple[int, ...], *args: Any) -> torch.Tensor:
    """A norm over the trailing dims `shape` of `x`, as one row of their product."""
    if tuple(x.shape[len(x.shape) - len(shape):]) != shape or x.dim() < len(shape):
        raise diag.ArgumentError(message=(
            f"{name}: expected an input whose last dims are {list(shape)}, got {list(x.shape)}"))
    if len(shape) == 1:  # no reshape, so the output is no view (FSDP2 warns of those)
        return program(name)(x, *(a.to(x.dtype) if isinstance(a, torch.Tensor) else a for a in args))
    rows = x.reshape(*x.shape[:x.dim() - len(shape)], math.prod(shape))
    flat = [a.reshape(-1).to(x.dtype) if isinstance(a, torch.Tensor) else a for a in args]
    return program(name)(rows, *flat).reshape(x.shape)


@_overridable
def rms_norm(input: torch.Tensor, normalized_shape: int | tuple[int, ...] | list[int] | torch.Size,  # noqa: A002
             weight: torch.Tensor | None = None, eps: float | None = None) -> torch.Tensor:
    """`torch.nn.functional.rms_norm`: over the trailing dims `normalized_shape`, `eps=None`
    meaning `torch.finfo(input.dtype).eps`; the output has the input's dtype."""
    shape = _shape(normalized_shape)
    eps = torch.finfo(input.dtype).eps if eps is None else eps
    if weight is None:
        return _normalize("rms_norm_unscaled", input, shape, eps)
    return _normalize("rms_norm", input, shape, weight, eps)


@_overridable
def layer_norm(input: torch.Tensor, normalized_shape: int | tuple[int, ...] | list[int] | torch.Size,  # noqa: A002
               weight: torch.Tensor | None = None, bias: torch.Tensor | None = None,
               eps: float = 1e-5) -> torch.Tensor:
    """`torch.nn.functional.layer_norm`: over the trailing dims `normalized_shape`; the
    output has the input's dtype."""
    shape = _shape(normalized_shape)
    if weight is None and bias is not None:  # no library kernel of its own: a weight of ones
        weight = torch.ones_like(bias)
    if weight is None:
        return _normalize("layer_norm_unscaled", input, shape, eps)
    if bias is None:
        return _normalize("layer_norm_scaled", input, shape, weight, eps)
    return _normalize("layer_norm", input, shape, weight, bias, eps)


@_overridable
def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
           gate_bias: torch.Tensor | None = None, up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None) -> torch.Tensor:
    """`down(silu(gate(x)) * up(x))` with nn.Linear's weights (`gate`, `up`: [hidden, dim];
    `down`: [dim, hidden]) and biases (the three or none)."""
    biases = (gate_bias, up_bias, down_bias)
    if all(b is None for b in biases):
        return program("swiglu")(x, gate, up, down)
    if any(b is None for b in biases):
        raise diag.ArgumentError(message=(
            "tiledsl.nn.swiglu: give the three biases (gate_bias, up_bias, down_bias) or none"))
    return program("swiglu_biased")(x, gate, gate_bias, up, up_bias, down, down_bias)


@_overridable
def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face's `apply_rotary_pos_emb(q, k, cos, sin)` (rotate-half): q `[B, H, S, D]`,
    k `[B, KH, S, D]`, cos and sin `[B, S, D]` (broadcast over the heads); one kernel for
    both."""
    return program("rotary")(q, k, cos, sin)


class TargetError(diag.TileDSLError, IndexError):
    """A class-index target of cross-entropy outside its classes. torch raises IndexError
    ("Target 7 is out of bounds."); this is an IndexError too, so code catching torch's
    catches it."""

    template = ("tiledsl.nn.cross_entropy: target {target} is out of bounds for {classes} classes "
                "(targets are 0 to {last}, or ignore_index {ignore_index})")


def _check_targets(labels: torch.Tensor, classes: int, ignore_index: int) -> None:
    """torch's rule: a target is a class, 0 to classes - 1, or ignore_index. Unchecked, the
    kernel's gather would read a negative one from the end and one past the end as 0, and
    give a plausible loss.

    Not the compiler's `check_bounds`: it accepts [-C, C) (a negative index counts from the
    end, as NumPy's), and it reads its counts on the host after every call, a device sync
    on CUDA (and a program with it is no CUDA graph). On the CPU, where reading the flag
    costs nothing, the check raises `TargetError` naming the first bad target, as torch's
    CPU kernel does. On CUDA, and whenever a tracer watches the call (`api.traced`: under
    torch.compile, make_fx or torch.jit.trace, where a host branch would be baked into the
    graph or break it), it is `torch._assert_async`: a device-side assert, as torch's CUDA
    kernel has, with no sync; it fails at the next sync ("device-side assert triggered"),
    or raises RuntimeError with the message below on the CPU.

    Its price on CUDA: about 7 small kernel launches per call (the three comparisons, the
    `&` and `|`, the `all` reduction and the assert), each over the targets only, no
    logits; small beside the loss's own kernels, but not free for a short batch."""
    from tiledsl.api import traced

    valid = ((labels >= 0) & (labels < classes)) | (labels == ignore_index)
    if labels.device.type == "cpu" and not traced((labels,), {}):
        if not valid.all():
            raise TargetError(target=int(labels[~valid][0]), classes=classes, last=classes - 1,
                              ignore_index=ignore_index)
        return
    torch._assert_async(valid.all(), (
        "tiledsl.nn.cross_entropy: a target is out of bounds (targets are class indices, 0 to "
        f"the number of classes - 1, or ignore_index {ignore_index})"))


def _loss_options(who: str, reduction: str, label_smoothing: float) -> None:
    if reduction not in ("mean", "sum", "none"):
        raise diag.OptionError(message=(
            f"{who}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}"))
    if not 0.0 <= label_smoothing <= 1.0:
        raise diag.OptionError(message=(
            f"{who}: label_smoothing must be in [0, 1], got {label_smoothing}"))


@_overridable
def cross_entropy(input: torch.Tensor, target: torch.Tensor, ignore_index: int = -100,  # noqa: A002
                  reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """`torch.nn.functional.cross_entropy` for class-index targets (see `CrossEntropyLoss`).
    A target that is neither a class nor `ignore_index` is an error (`_check_targets`)."""
    _loss_options("tiledsl.nn.cross_entropy", reduction, label_smoothing)
    if target.is_floating_point():
        raise diag.ArgumentError(message=(
            "tiledsl.nn.cross_entropy: class-index targets only (probability targets are not "
            "supported)"))
    classes = input.shape[1] if input.dim() > 1 else input.shape[0]
    logits = input.movedim(1, -1) if input.dim() > 2 else input
    logits = logits.reshape(-1, classes)
    labels = target.reshape(-1).long()
    _check_targets(labels, classes, ignore_index)
    if label_smoothing > 0:
        loss = program("cross_entropy_smoothed")(logits, labels, ignore_index, float(label_smoothing))
    else:  # torch's plain path: the smoothing term, inf in a row with a -inf logit, not computed
        loss = program("cross_entropy")(logits, labels, ignore_index)
    if reduction == "none":
        return loss.reshape(target.shape if input.dim() > 1 else ()).to(input.dtype)
    total = loss.sum()
    if reduction == "mean":
        total = total / (labels != ignore_index).sum()
    return total.to(input.dtype)


_ATTENTION = """kernel attention[T: f16 | bf16 | f32](q: T[..., M, D], k: T[..., N, D],
                                                  v: T[..., N, DV]) -> T[..., M, DV] {{
    s = q @ k.T * rsqrt(D)
    s = {score_mod}
    return softmax(s, axis=-1) @ v
}}"""
# each score_mod's program while something holds it (an Attention module, `attention`'s
# recent ones): modules sharing a score_mod share a program (and its op), and one no longer
# held is collected, which releases its op (tiledsl.torch_op), as any program's is
_ATTENTION_PROGRAMS: weakref.WeakValueDictionary[str | None, Any] = weakref.WeakValueDictionary()
# the programs the function `attention` ran last, held, so that a loop of its calls does not
# compile one each time, nor a graph torch.compile traced from it (which runs the program's
# op) find its program collected; bounded (past it, the one added first is dropped), so they
# are not kept for the process
_RECENT_ATTENTION: dict[str | None, Any] = {}
_RECENT_LIMIT = 16


def _attention_program(score_mod: str | None) -> Any:
    if score_mod is not None and not isinstance(score_mod, str):  # before the lookup: a list is unhashable
        raise diag.OptionError(message=(
            f"tiledsl.nn.Attention: score_mod must be DSL text (a str), got {type(score_mod).__name__}"))
    fn = _ATTENTION_PROGRAMS.get(score_mod)
    if fn is not None:
        return fn
    import tiledsl

    fn = tiledsl.compile(_ATTENTION.format(score_mod="s" if score_mod is None else f"({score_mod})"))
    if len(fn.kernel.body) != 3:  # the text was more than one expression
        raise diag.OptionError(message=(
            f"tiledsl.nn.Attention: score_mod must be one expression, got '{score_mod}'"))
    _ATTENTION_PROGRAMS[score_mod] = fn
    return fn


@_overridable
def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              score_mod: str | None = None) -> torch.Tensor:
    """`Attention(score_mod)(q, k, v)` as a function (each `score_mod` compiled on first use;
    the last `_RECENT_LIMIT` first used here are held, see `_RECENT_ATTENTION`)."""
    fn = _RECENT_ATTENTION.get(score_mod) if score_mod is None or isinstance(score_mod, str) else None
    if fn is None:
        fn = _attention_program(score_mod)
        _RECENT_ATTENTION[score_mod] = fn
        if len(_RECENT_ATTENTION) > _RECENT_LIMIT:
            del _RECENT_ATTENTION[next(iter(_RECENT_ATTENTION))]
    return fn(q, k, v)


class _Norm(nn.Module):
    """What torch's RMSNorm and LayerNorm share: `normalized_shape` (an int or a shape, the
    trailing dims normalized as one row), `eps`, and a `weight` of that shape, initialized
    to ones, when `elementwise_affine`."""

    def __init__(self, normalized_shape, eps: float | None, elementwise_affine: bool, device, dtype) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            self.weight = nn.Parameter(torch.ones(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("weight", None)

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def extra_repr(self) -> str:
        return f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"


class RMSNorm(_Norm):
    """`torch.nn.RMSNorm`: the same arguments, `weight` (when `elementwise_affine`), and
    `eps=None` meaning `torch.finfo(x.dtype).eps`. The output has the input's dtype."""

    def __init__(self, normalized_shape, eps: float | None = None, elementwise_affine: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.normalized_shape, self.weight, self.eps)


class LayerNorm(_Norm):
    """`torch.nn.LayerNorm`: the same arguments (`bias=False` keeps only `weight`) and
    parameters. The output has the input's dtype."""

    def __init__(self, normalized_shape, eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, device=None, dtype=None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, device, dtype)
        if elementwise_affine and bias:
            self.bias = nn.Parameter(torch.zeros(self.normalized_shape, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class SwiGLU(nn.Module):
    """A gated MLP, `down_proj(silu(gate_proj(x)) * up_proj(x))`, with Hugging Face's
    submodule names (`gate_proj`, `up_proj`: dim -> hidden; `down_proj`: hidden -> dim), so
    a LlamaMLP's checkpoint loads. The three projections run as two GEMMs (the gate and up
    projections one dual GEMM with the activation in its epilogue)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"bias": bias, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(dim, hidden, **kw)
        self.up_proj = nn.Linear(dim, hidden, **kw)
        self.down_proj = nn.Linear(hidden, dim, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g, u, d = self.gate_proj, self.up_proj, self.down_proj
        return swiglu(x, g.weight, u.weight, d.weight, g.bias, u.bias, d.bias)


class CrossEntropyLoss(nn.Module):
    """`torch.nn.CrossEntropyLoss` for class-index targets: `ignore_index`,
    `label_smoothing` and `reduction` ("mean" over the targets not ignored, "sum",
    "none"); classes at dim 1 of an input of rank > 2, as torch's. Per-class `weight` and
    probability targets are not supported (refused with an error). -inf logits (a padded
    vocabulary, masked tokens) give torch's results; a target that is neither a class nor
    `ignore_index` raises `TargetError` (an IndexError) on the CPU, and is a device-side
    assert on CUDA or in a traced graph, as torch's (see `_check_targets`)."""

    def __init__(self, weight: torch.Tensor | None = None, size_average=None, ignore_index: int = -100,
                 reduce=None, reduction: str = "mean", label_smoothing: float = 0.0) -> None:
        super().__init__()
        if weight is not None or size_average is not None or reduce is not None:
            raise diag.OptionError(message=(
                "tiledsl.nn.CrossEntropyLoss: per-class weight and the deprecated size_average/reduce "
                "are not supported"))
        _loss_options("tiledsl.nn.CrossEntropyLoss", reduction, label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing

    def forward(self, input: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # noqa: A002 - torch's
        return cross_entropy(input, target, self.ignore_index, self.reduction, self.label_smoothing)


class Attention(nn.Module):
    """Scaled dot-product attention, `attn(q, k, v)`, SDPA's default scale 1/sqrt(D), with an
    optional score modification written in the DSL: an expression in `s` (the scaled
    scores), `index(s, -2)` (the query's position) and `index(s, -1)` (the key's), e.g.
    `"where(index(s, -1) <= index(s, -2), s, -inf)"` (causal) or `"30.0 * tanh(s / 30.0)"`
    (a soft cap). It compiles with the module (errors point into `score_mod`); q, k and v
    have any number of batch dims."""

    def __init__(self, score_mod: str | None = None) -> None:
        super().__init__()
        self.program = _attention_program(score_mod)  # the module keeps it alive: the cache is weak
        self.score_mod = score_mod

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if has_torch_function((q, k, v)):  # a tracer (symbolic_trace): one `attention` node
            return attention(q, k, v, self.score_mod)
        return self.program(q, k, v)

    def extra_repr(self) -> str:
        return f"score_mod={self.score_mod!r}"
