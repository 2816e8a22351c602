"""Names in a program: any identifier names a dim (Python keywords included); the words the
grammar reads as literals (`inf`, `true`, `false`, `None`) name nothing (issue 26)."""

from __future__ import annotations

import pytest
import torch

import tiledsl
from helpers import randn, run_checked
from tiledsl import diagnostics as diag


def test_dims_named_like_python_keywords_work():
    """Dim expressions were read with Python's parser: `def // 2` was a raw SyntaxError."""
    fn, (half, total) = run_checked("""kernel f(x: f32[in, def], y: f32[def]) -> (f32[in, def // 2], f32[in]) {
        return x[:, :def // 2] * y[:def // 2] + in, sum(x, axis=-1) / def
    }""", randn(3, 17), randn(17))
    assert half.shape == (3, 8) and total.shape == (3,)


@pytest.mark.parametrize("word, meaning", [
    ("inf", "the float literal inf"), ("true", "the bool literal true"),
    ("false", "the bool literal false"), ("None", "None (axis=None, x[:, None])")])
def test_a_literal_word_cannot_name_a_parameter_or_a_dim(word, meaning):
    """Such a parameter was accepted, and every use of it read the literal instead."""
    with pytest.raises(diag.LiteralNameError) as err:
        tiledsl.compile(f"kernel f({word}: f32[N]) -> f32[N] {{ return {word} * 2.0 }}")
    assert str(err.value).splitlines()[0] == (
        f"<string>:1:10: error: '{word}' cannot name a parameter: in an expression it is {meaning}")
    with pytest.raises(diag.LiteralNameError) as err:
        tiledsl.compile(f"kernel f(x: f32[{word}]) -> f32[{word}] {{ return x }}")
    assert str(err.value).splitlines()[0] == (
        f"<string>:1:17: error: '{word}' cannot name a dim: in an expression it is {meaning}")


def test_names_close_to_literal_words_are_ordinary_names():
    fn = tiledsl.compile("kernel f(Inf: f32[N], true_: f32[N], none: f32) -> f32[N] { return Inf * true_ + none }")
    x, y = randn(5), randn(5)
    torch.testing.assert_close(fn(x, y, 0.5), x * y + 0.5)
