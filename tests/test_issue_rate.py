"""benchmarks.issue_rate: it times how many instructions a core issues, not how long one takes."""

import json
import os
import platform
import shutil

import pytest

from benchmarks.issue_rate import _compile, _rates, instructions, main

pytestmark = [pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instructions"),
              pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="needs a C compiler")]


def test_independent_accumulators_issue_faster_than_one_chain(tmp_path):
    """16 independent FMAs per loop against the same 16 on one accumulator (the control: each waits for
    the previous one's latency, 4-5 cycles where two issue per cycle): the rate must tell them apart."""
    _, reg = instructions()
    core = [min(os.sched_getaffinity(0))]
    many = _rates(_compile("vfmadd231ps", reg, tmp_path), 0.2, core)[0]
    one = _rates(_compile("vfmadd231ps", reg, tmp_path, chains=1), 0.2, core)[0]
    assert 0.05 < one < 0.5 * many


def test_the_report_names_each_instruction_with_its_rates(capsys):
    assert main(["--seconds", "0.05", "--repeats", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    table, reg = instructions()
    assert out["registers"] == reg and set(out["instructions"]) == set(table)
    for name, row in out["instructions"].items():
        assert row["multiply_adds_each"] == table[name]
        assert row["G_per_s_one_core"] > 0.05 and row["G_per_s_per_core_all_cores"] > 0.05
        assert row["G_multiply_adds_per_s_all_cores"] == pytest.approx(
            row["G_per_s_per_core_all_cores"] * table[name] * out["cores"], rel=0.02)


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        main(["--seconds", "0"])
