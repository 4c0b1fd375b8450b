"""``analysis._common.group_rows``: the one grouping of rows by several keys that ``shapes()``,
``efficiency()``, the flow pairing of ``layers()`` and the source tables share. Checked
against the definition it promises: ``pd.factorize`` of the row tuples (groups numbered in
order of first appearance, a missing value one value) and pandas' own
``groupby(sort=False, dropna=False, observed=True)``."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tracemagic.analysis._common import group_rows


def _expected(columns: list[pd.Series]) -> tuple[list[int], list[int]]:
    """Each row's group and each group's first row, from the row tuples themselves."""
    seen: dict[tuple[object, ...], int] = {}
    group, first = [], []
    rows = zip(*[[None if pd.isna(v) else v for v in column.astype(object).tolist()] for column in columns])
    for row, values in enumerate(rows):
        if values not in seen:
            seen[values] = len(seen)
            first.append(row)
        group.append(seen[values])
    return group, first


def _column(rng: np.random.Generator, rows: int, kind: str, distinct: int) -> pd.Series:
    if kind == "categorical":  # with categories no row uses, and missing values
        codes = rng.integers(-1, distinct, rows)
        return pd.Series(pd.Categorical.from_codes(codes, categories=[f"c{i}" for i in range(distinct + 3)]))
    if kind == "float":  # with NaN
        values = rng.integers(0, distinct, rows).astype(float)
        values[rng.random(rows) < 0.1] = np.nan
        return pd.Series(values)
    return pd.Series(rng.integers(-(2**62), 2**62, distinct)[rng.integers(0, distinct, rows)])  # large ints


@pytest.mark.parametrize("seed", range(40))
def test_groups_are_the_row_tuples_in_order_of_first_appearance(seed: int) -> None:
    rng = np.random.default_rng(seed)
    rows = int(rng.integers(0, 300))
    kinds = rng.choice(["categorical", "float", "int"], size=int(rng.integers(1, 6)))
    columns = [_column(rng, rows, str(kind), int(rng.integers(1, 12))) for kind in kinds]
    group, first = group_rows(*columns)
    assert (group.tolist(), first.tolist()) == _expected(columns)
    # as numpy arrays and categoricals rather than Series: the same groups
    again, _ = group_rows(*[c.array if isinstance(c.dtype, pd.CategoricalDtype) else c.to_numpy() for c in columns])
    assert again.tolist() == group.tolist()
    if rows:  # pandas' own grouping numbers the groups alike
        frame = pd.DataFrame({f"k{i}": c for i, c in enumerate(columns)})
        pandas = frame.groupby(list(frame.columns), sort=False, dropna=False, observed=True).ngroup()
        assert pandas.tolist() == group.tolist()


def test_keys_too_wide_for_one_int64_are_renumbered() -> None:
    """Six categoricals of 2**20 categories each: their codes as digits of one key would need
    120 bits; the key is renumbered on the way and the groups stay exact."""
    rng = np.random.default_rng(7)
    columns = [
        pd.Series(pd.Categorical.from_codes(rng.integers(-1, 3, 500) * 99_991 % 2**20, categories=np.arange(2**20)))
        for _ in range(6)
    ]
    group, first = group_rows(*columns)
    assert (group.tolist(), first.tolist()) == _expected(columns)
