"""``trainbridge plot``: a PNG from a metrics file; clear errors when there is nothing to plot."""

import importlib.util
import json

import pytest

from trainbridge import cli
from trainbridge.report.plot import PlotError, plot_metrics, read_series

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
needs_matplotlib = pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None, reason="matplotlib (the 'plot' extra) is not installed"
)


def _write_metrics(path, steps=12):
    records = []
    for step in range(1, steps + 1):
        records.append(
            {
                "time": 0.0,
                "step": step,
                "epoch": step / steps,
                "loss": 3.0 / step,
                "grad_norm": 1.0,
                "learning_rate": 1e-3,
                "tokens_per_second": 1000.0 + step,
            }
        )
        if step % 4 == 0:
            records.append({"time": 0.0, "step": step, "epoch": step / steps, "eval_loss": 2.5 / step})
    path.write_text("\n".join(json.dumps(r) for r in records) + '\n{"cut short')
    return path


@needs_matplotlib
def test_plot_command_writes_a_png_and_prints_its_path(tmp_path, capsys):
    _write_metrics(tmp_path / "metrics.jsonl")
    assert cli.main(["plot", str(tmp_path)]) == 0
    out = capsys.readouterr().out.strip()
    assert out == str(tmp_path / "metrics.png")
    data = (tmp_path / "metrics.png").read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 10_000


def test_series_keep_step_and_skip_a_truncated_line(tmp_path):
    series = read_series(_write_metrics(tmp_path / "m.jsonl"))
    assert series["eval_loss"][0] == [4, 8, 12] and len(series["loss"][1]) == 12


@needs_matplotlib
def test_output_path_can_be_chosen(tmp_path):
    metrics = _write_metrics(tmp_path / "m.jsonl")
    assert plot_metrics(metrics, tmp_path / "sub" / "p.png") == tmp_path / "sub" / "p.png"
    assert (tmp_path / "sub" / "p.png").read_bytes().startswith(PNG_MAGIC)


def test_missing_metrics_is_exit_2_naming_the_folder(tmp_path, capsys):
    assert cli.main(["plot", str(tmp_path)]) == 2
    assert f"no metrics.jsonl in '{tmp_path}'" in capsys.readouterr().err


def test_nothing_plottable_is_named(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "train_runtime": 3.0}\n')
    with pytest.raises(PlotError, match="no logged loss"):
        plot_metrics(tmp_path)


def test_missing_matplotlib_names_the_extra(tmp_path, monkeypatch):
    import sys

    _write_metrics(tmp_path / "metrics.jsonl")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(PlotError, match=r"trainbridge\[plot\]"):
        plot_metrics(tmp_path)
