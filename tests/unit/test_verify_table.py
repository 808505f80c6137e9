"""`verify`'s table (cli/render.print_checks, train/compare.RankCheck): on a GPU it sets the
forecast made without the GPU (fake CUDA) beside the GPU-profiled forecast and the measured peak
(issue 52); elsewhere the columns stay as they were."""

from __future__ import annotations

from capture_megatron.cli.render import print_checks
from capture_megatron.train.compare import RankCheck

MIB = 1 << 20


def test_a_gpu_run_shows_the_forecast_without_the_gpu(capsys):
    rows = [RankCheck(0, 102 * MIB, 100 * MIB, 110 * MIB, 104 * MIB)]
    print_checks(rows, 0.02)
    header, row, note = capsys.readouterr().out.splitlines()
    assert "without GPU MiB" in header
    assert row.split() == ["0", "102.000", "100.000", "+2.00%", "110.000", "104.000", "+4.00%"]
    assert "fake CUDA" in note
    assert rows[0].without_gpu_error == 0.04


def test_a_cpu_run_shows_no_such_column(capsys):
    print_checks([RankCheck(0, 99 * MIB, 100 * MIB, 0)], 0.02)
    header, row = capsys.readouterr().out.splitlines()
    assert "without GPU" not in header and len(row.split()) == 5
