"""The planner's rows are values: the table's columns are their fields, a phase's answer keeps
what an earlier phase found, and what was not computed is missing in the table."""
import dataclasses
import math

import pytest

from pipesim.planner import SearchSpace, search
from pipesim.planner.rows import (COLUMNS, INVALID, PRUNED_TIME, SIMULATED, Assessment,
                                  PlanConfig, PlanFigures, PlanRow)

GiB = 2 ** 30
CONFIG = PlanConfig("k", "1f1b", 1, 1, 2, 1, 4, 1, "alltoall", 1, 8, "none", 0)


def test_the_table_columns_are_the_row_fields_in_order():
    figures = [f.name for f in dataclasses.fields(PlanFigures)]
    assert COLUMNS[:13] == tuple(f.name for f in dataclasses.fields(PlanConfig))
    assert COLUMNS[13:17] == ("status", "reason", "step_time_bound", "memory_bound")
    assert list(COLUMNS[17:]) == figures and len(set(COLUMNS)) == len(COLUMNS)
    res = search(SearchSpace("tiny", gpus=4, gbs=8, hardware="A100"), workers=1)
    assert list(res.rows.columns) == list(COLUMNS)
    pruned = res.rows[res.rows["status"] == PRUNED_TIME]
    assert len(pruned) and pruned["step_time"].isna().all()            # not computed: missing
    assert pruned["step_time_bound"].notna().all()


def test_a_later_phase_keeps_what_an_earlier_one_found():
    row = PlanRow(CONFIG).merged(Assessment("", step_time_bound=1.5, memory_bound=2e9))
    row = row.merged(Assessment(PRUNED_TIME, "bound above"))
    assert (row.status, row.reason, row.step_time_bound, row.memory_bound) == (
        PRUNED_TIME, "bound above", 1.5, 2e9)
    record = row.record()
    assert record["key"] == "k" and "step_time" not in record and "fits" not in record
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.status = SIMULATED


def test_an_assessment_sets_only_what_it_says():
    assert Assessment(INVALID, "no").columns() == {"status": INVALID, "reason": "no"}
    figures = PlanFigures(1.0, 2.0, 0.3, 0.4, 0.1, 0.2, 3.0, 1, 4.0, True, 1, 1, 1, 1, 1)
    cols = Assessment(SIMULATED, figures=figures, sim_s=0.5).columns()
    assert cols["step_time"] == 1.0 and cols["fits"] is True and "sim_s" not in cols
    assert not math.isnan(cols["headroom"])
