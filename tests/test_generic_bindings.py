"""Bindings given by hand (`--bind`, `Generic.specialize`) and the ones `tiledsl check`
checks stay small whatever the text asks for: a rank past the limit is refused before a
batch dim is named, and a kernel with many dtype variables is checked on a covering set,
not on every combination."""

import itertools
import math
import time

import pytest
from test_cli import cli

import tiledsl
from tiledsl import covering
from tiledsl import diagnostics as diag
from tiledsl.types import PARAM_DTYPES

SCALE = "kernel scale[T: f16 | f32](x: T[..., N], s: f32) -> T[..., N] {\n    return x * s\n}\n"
RANK_ERROR = "rank {rank} exceeds the limit of 8"


@pytest.fixture
def scale_file(tmp_path):
    path = tmp_path / "scale.tdsl"
    path.write_text(SCALE)
    return str(path)


@pytest.mark.parametrize("batch", [8, 100_000_000, 10**18])
def test_specialize_refuses_a_rank_past_the_limit_before_naming_its_dims(batch):
    fn = tiledsl.compile(SCALE)
    start = time.perf_counter()
    with pytest.raises(diag.LimitError) as info:
        fn.specialize(T="f32", batch=batch)
    assert time.perf_counter() - start < 1  # 10^8 names took 110 s and 3.4 GB
    assert info.value.message == RANK_ERROR.format(rank=batch + 1)
    assert (info.value.line, info.value.column) == (1, 31)  # x's type, as sema says it
    assert fn.specialize(T="f32", batch=7).ir("graph").startswith(
        "func @scale(%x: f32[batch0, batch1, batch2, batch3, batch4, batch5, batch6, N]")


def test_the_rank_error_names_the_first_type_past_the_limit():
    fn = tiledsl.compile("kernel f[T: f32](x: T[..., A, B], y: T[..., A, B, C]) -> T[..., A, B, C] "
                         "{ return x[..., None] + y }")
    with pytest.raises(diag.LimitError) as info:
        fn.specialize(T="f32", batch=6)
    assert (info.value.message, info.value.column) == (RANK_ERROR.format(rank=9), 38)  # y's type


def test_bind_refuses_a_rank_past_the_limit_at_once(scale_file):
    start = time.perf_counter()
    code, out, err = cli("explain", scale_file, "--bind", "T=f32,...=100000000")
    assert time.perf_counter() - start < 1
    assert (code, out) == (1, "")
    assert err.splitlines()[0] == f"{scale_file}:1:31: error: {RANK_ERROR.format(rank=100000001)}"


@pytest.mark.parametrize(("value", "message"), [
    ("²", "'...' takes a number of dims, got '²'"),
    ("١", "'...' takes a number of dims, got '١'"),
    ("-1", "'...' takes a number of dims, got '-1'"),
    ("9" * 5000, "'...' takes a number of dims; 5000 digits pass the rank limit of 8"),
])
def test_bind_with_a_batch_that_is_not_ascii_digits_is_one_line(scale_file, value, message):
    code, out, err = cli("triton", scale_file, "--bind", f"T=f32,...={value}")
    shown = f"T=f32,...={value}"
    shown = shown if len(value) < 100 else shown[:80] + "..."
    assert (code, out, err) == (1, "", f"error: --bind {shown}: {message}\n")


def test_bind_with_leading_zeros_is_the_number(scale_file):
    code, out, _ = cli("opt", scale_file, "--bind", "T=f16,...=0002", "--no-lower", "--passes", "")
    assert code == 0 and out.startswith("func @scale(%x: f16[batch0, batch1, N]")


# --- tiledsl check: every combination while few, else a covering set ------------------------


def generic_file(tmp_path, variables: int, dtypes, body: str | None = None) -> str:
    names = [f"V{i}" for i in range(variables)]
    choices = " | ".join(dtypes)
    params = ", ".join(f"{n.lower()}: {n}[N]" for n in names)
    body = body or " + ".join(f"cast({n.lower()}, f32)" for n in names)
    path = tmp_path / "many.tdsl"
    path.write_text(f"kernel k[{', '.join(f'{n}: {choices}' for n in names)}]({params}) -> f32[N] {{\n"
                    f"    return {body}\n}}\n")
    assert len(path.read_text()) < 1024 or variables > 8
    return str(path)


def test_check_of_eight_variables_of_every_dtype_checks_a_pairwise_covering_set(tmp_path):
    path = generic_file(tmp_path, 8, PARAM_DTYPES)
    start = time.perf_counter()
    code, out, err = cli("check", path)
    assert time.perf_counter() - start < 60  # 2 * 10^8 bindings never finished
    assert (code, err) == (0, "")
    assert out == (f"{path}: kernel 'k' ok (207 bindings of {11**8}: every pair of dtypes of two "
                   "variables)\n")


def test_check_of_very_many_variables_checks_each_dtype_of_each(tmp_path):
    path = generic_file(tmp_path, 30, PARAM_DTYPES)
    code, out, err = cli("check", path)
    assert (code, err) == (0, "")
    assert out == f"{path}: kernel 'k' ok (11 bindings of about 10^31: every dtype of each variable)\n"


def test_check_of_few_combinations_checks_every_one(tmp_path):
    path = generic_file(tmp_path, 3, ("f16", "f32", "i8", "i32"))  # 64
    code, out, _ = cli("check", path)
    assert code == 0 and out.startswith(f"{path}: kernel 'k' ok (64 bindings: V0=f16,V1=f16,V2=f16; ")


def test_check_finds_an_error_only_a_pair_of_dtypes_makes_and_names_the_binding(tmp_path):
    # (a @ b) fails only where exactly one of A and B is i8: each dtype of each variable
    # alone (f16 with f16, f32 with f32, i8 with i8) would never meet it
    names = "ABCDEFGH"
    choices = " | ".join(("f16", "f32", "i8"))
    params = ", ".join(["a: A[M, K]", "b: B[K, N]"] + [f"{n.lower()}: {n}[N]" for n in names[2:]])
    rest = " + ".join(f"cast({n.lower()}, f32)" for n in names[2:])
    path = tmp_path / "pairs.tdsl"
    path.write_text(f"kernel k[{', '.join(f'{n}: {choices}' for n in names)}]({params}) -> f32[M, N] {{\n"
                    f"    return cast(a @ b, f32) + {rest}\n}}\n")
    code, out, err = cli("check", str(path))
    assert (code, out) == (1, "")
    lines = err.splitlines()
    assert lines[0] == (f"{path}:2:17: error: an i8 matmul needs both operands in i8, got f16 @ i8; "
                        "cast the f16 operand")
    assert lines[-1] == "note: with the binding A=f16,B=i8,C=i8,D=i8,E=i8,F=i8,G=i8,H=i8"


@pytest.mark.parametrize("domains", [[2, 2], [3, 3, 3], [11] * 8, [2, 11, 3, 1, 5, 7], [4] * 12, [1], [5]])
def test_pairwise_rows_cover_every_pair(domains):
    rows = covering.pairwise(domains)
    assert all(len(r) == len(domains) and all(0 <= c < d for c, d in zip(r, domains, strict=True)) for r in rows)
    assert covering.covers_pairs(rows, domains)
    pairs = list(itertools.combinations(range(len(domains)), 2))
    assert {(i, j, r[i], r[j]) for r in rows for i, j in pairs} == {  # checked without covering
        (i, j, a, b) for i, j in pairs for a in range(domains[i]) for b in range(domains[j])}
    for i, d in enumerate(domains):  # and every choice
        assert {r[i] for r in rows} == set(range(d))
    assert len(rows) <= max(math.prod(domains), 3 * max(domains) ** 2)
    assert rows == covering.pairwise(domains)  # deterministic


def test_each_choice_rows_take_every_choice_once_at_least():
    rows = covering.each_choice([3, 1, 5])
    assert rows == [(0, 0, 0), (1, 0, 1), (2, 0, 2), (0, 0, 3), (1, 0, 4)]


def test_pair_count_counts_pairs_of_two_variables():
    domains = [2, 3, 4]
    assert covering.pair_count(domains) == sum(a * b for a, b in itertools.combinations(domains, 2))
