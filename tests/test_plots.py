"""`dtx plot`: one PNG per metric from runs' records; a resumed run's re-logged steps count once."""

import json

from dtx.tools.cli import main
from dtx.tools.plots import metric_series


def _run(path, records):
    path.mkdir()
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_series_keeps_the_last_record_per_step():
    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}, {"step": 2, "loss": 1.4}, {"step": 3, "x": "a"}]
    assert metric_series(records, "loss") == ([1, 2], [2.0, 1.4])


def test_plot_writes_one_png_per_metric(tmp_path, capsys):
    a = _run(tmp_path / "a", [{"step": s, "loss": 1.0 / s, "accuracy": s / 10} for s in range(1, 6)])
    b = _run(tmp_path / "b", [{"step": s, "loss": 2.0 / s} for s in range(1, 6)] + [{"step": 5, "test_accuracy": 0.9}])
    assert main(["plot", a, b, "--out", str(tmp_path / "plots"), "--metrics", "loss,accuracy,test_accuracy"]) == 0
    for key in ("loss", "accuracy", "test_accuracy"):
        png = tmp_path / "plots" / f"{key}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_errors(tmp_path, capsys):
    assert main(["plot", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    a = _run(tmp_path / "a", [{"step": 1, "loss": 1.0}])
    assert main(["plot", a, "--metrics", "nothing"]) == 2


def test_quality_metrics_against_time_and_bytes(tmp_path):
    records = [{"step": 0, "num_params": 10}]
    records += [{"step": s, "loss": 1.0 / s, "elapsed_s": 0.5 * s, "comm_bytes_total": 100.0 * s} for s in (2, 4)]
    records += [{"step": 5, "test_accuracy": 0.9}]  # an evaluation record: no time, no bytes of its own
    assert metric_series(records, "loss", "elapsed_s") == ([1.0, 2.0], [0.5, 0.25])
    assert metric_series(records, "test_accuracy", "comm_bytes_total") == ([400.0], [0.9])
    assert metric_series([{"step": 1, "test_accuracy": 0.5}], "test_accuracy", "elapsed_s") == ([], [])
    run = _run(tmp_path / "r", records)
    assert main(["plot", run, "--out", str(tmp_path / "p")]) == 0
    names = sorted(p.name for p in (tmp_path / "p").iterdir())
    assert names == ["loss.png", "loss_vs_bytes.png", "loss_vs_time.png", "test_accuracy.png",
                     "test_accuracy_vs_bytes.png", "test_accuracy_vs_time.png"]
    assert main(["plot", run, "--x", "step,wall"]) == 2


def test_panels_share_colours_and_styles(tmp_path):
    from dtx.tools.plots import Line, Panel, panels_plot

    path = panels_plot([Panel({"a": ([1, 2], [1, 4]), "a model": Line([1, 2], [1, 3], "--", same_color_as="a")},
                              xlabel="x", logx=True, logy=True),
                        Panel({"b": ([1, 2], [2, 2])})], tmp_path / "sub" / "two.png", title="two panels")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
