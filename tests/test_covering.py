"""`helpers.pairwise`, the covering array the slow parity matrices are drawn from: every pair of
option values that can occur together occurs, the same rows every time, in fewer rows than the
product; and the matrices drawn from it (default cases and slow ones together) hold every pair."""

import itertools
import os
import subprocess
import sys

import pytest

from helpers import pairwise

# A realistic matrix: a mesh of 8 devices as (data, stage, model) sizes, a schedule exactly where
# there is a pipeline, a ZeRO stage with its placement, an architecture. 340 of the product's
# 3840 rows are valid.
MESH = {"d": (1, 2, 4, 8), "p": (1, 2, 4, 8), "t": (1, 2, 4, 8),
        "schedule": (None, "gpipe", "1f1b", "interleaved_1f1b", "zb_h1", "1f1b_lockstep"),
        "zero": ((0, None), (1, None), (2, None), (3, "microbatch"), (3, "step")), "arch": ("llama", "gpt2")}


def on_8(row):
    return row["d"] * row["p"] * row["t"] == 8 and (row["schedule"] is None) == (row["p"] == 1)


MUST = [{"d": 8, "p": 1, "t": 1, "schedule": None, "zero": (3, "step"), "arch": "gpt2"},
        {"d": 2, "p": 2, "t": 2, "schedule": "zb_h1", "zero": (0, None), "arch": "llama"}]

CASES = {
    "no-rule": ({"a": (0, 1, 2), "b": ("x", "y"), "c": (None, (1, 2), "z"), "d": (True, False)}, None, []),
    "mesh-of-8": (MESH, on_8, []),
    "mesh-of-8-with-rows": (MESH, on_8, MUST),
}


def valid_rows(options, valid):
    rows = [dict(zip(options, values)) for values in itertools.product(*options.values())]
    return [r for r in rows if valid is None or valid(r)]


def pairs_in(rows, names):
    return {(a, repr(r[a]), b, repr(r[b])) for r in rows for a, b in itertools.combinations(names, 2)}


@pytest.mark.parametrize("case", CASES)
def test_every_pair_that_can_occur_occurs(case):
    options, valid, must = CASES[case]
    rows = pairwise(options, must=must, valid=valid)
    assert rows[:len(must)] == must
    assert all(valid is None or valid(r) for r in rows) and all(set(r) == set(options) for r in rows)
    assert len({repr(r) for r in rows}) == len(rows)  # no row twice
    needed = pairs_in(valid_rows(options, valid), list(options))
    assert pairs_in(rows, list(options)) == needed
    # The check above sees too few rows: the last row covered a pair that no other row does.
    assert pairs_in(rows[:-1], list(options)) != needed


def test_fewer_rows_than_the_product_and_no_fewer_than_a_pair_of_options_needs():
    rows, product = pairwise(MESH, valid=on_8), valid_rows(MESH, on_8)
    # Each schedule meets each ZeRO placement in some row (5 x 5 + 5 without a pipeline): 30 at least.
    least = max(len({(r[a], r[b]) for r in product}) for a, b in itertools.combinations(MESH, 2))
    assert least == 30 and least <= len(rows) < len(product) == 340
    assert len(rows) <= 45, len(rows)  # 39 when written; the greedy choice must not drift far


def test_the_same_rows_every_time_whatever_the_hash_seed():
    rows = pairwise(MESH, must=MUST, valid=on_8)
    assert pairwise(MESH, must=MUST, valid=on_8) == rows
    script = ("import sys; sys.path.insert(0, sys.argv[1]); import test_covering as c; "
              "print(repr(c.pairwise(c.MESH, must=c.MUST, valid=c.on_8)))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", script, os.path.dirname(__file__)], capture_output=True,
                             text=True, env={**os.environ, "PYTHONHASHSEED": seed}, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == repr(rows)


def test_a_required_row_that_cannot_run_is_refused():
    with pytest.raises(ValueError, match="not a valid row"):
        pairwise(MESH, must=[{**MUST[0], "d": 4}], valid=on_8)


# The matrices' modules are imported by the test, not with this module: the hash-seed test's fresh
# interpreters need only `helpers`.
def _pipeline():
    import test_pipeline as m
    return m.OPTIONS, None, m.DEFAULT, m.SLOW, m.as_row


def _composition():
    import test_composition as m
    return m.OPTIONS, m.runs, m.DEFAULT, m.SLOW, m.as_row


def _zero():
    import test_zero as m
    slow = [c for c in m.CASES if c.marks]
    fast = [c for c in m.CASES if not c.marks]
    return m.OPTIONS, None, fast, slow, lambda c: dict(zip(("arch", "zero", "data", "microbatches"), c.values))


# The slow cases each file's comment and docs/tests.md count.
@pytest.mark.parametrize("matrix, count", [(_pipeline, 9), (_composition, 45), (_zero, 4)],
                         ids=["pipeline", "composition", "zero"])
def test_each_slow_matrix_with_its_default_cases_holds_every_pair(matrix, count):
    options, valid, default, slow, as_row = matrix()
    assert len(slow) == count
    rows = [as_row(c) for c in default + slow]
    assert all(valid is None or valid(r) for r in rows)
    assert pairs_in(rows, list(options)) == pairs_in(valid_rows(options, valid), list(options))
    # and the slow tier adds cases: none of the default ones again
    assert not {repr(as_row(c)) for c in slow} & {repr(as_row(c)) for c in default}
