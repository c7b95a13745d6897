"""`dtx plot`: one PNG per metric from runs' records; a resumed run's re-logged steps count once."""

import json
import os

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


def _runs_evaluated_at_the_end():
    a = [{"step": s, "loss": 1.0 / s, "step_time_ms": 5.0} for s in (4, 8)] + [{"step": 8, "test_accuracy": 0.9}]
    b = [{"step": s, "loss": 2.0 / s, "step_time_ms": 5.0} for s in (4, 8)] + [{"step": 8, "test_accuracy": 0.9}]
    return {"a": a, "b": b}


def test_a_metric_every_run_records_once_is_drawn_as_one_labelled_bar_per_run(tmp_path):
    """The finding: two runs with equal final accuracy were two dots on one spot, one hiding the other."""
    from dtx.tools.plots import _panel

    panel = _panel(_runs_evaluated_at_the_end(), "test_accuracy", "step", {})
    assert panel.kind == "bars" and list(panel.series) == ["a", "b"] and panel.bar_x_label == "step"
    assert panel.ylabel == "test accuracy (fraction of the test set)"
    assert _panel(_runs_evaluated_at_the_end(), "loss", "step", {}).kind == "lines"
    written = plot_runs_to(tmp_path, _runs_evaluated_at_the_end(), ["test_accuracy", "loss"])
    assert sorted(os.path.basename(p) for p in written) == ["loss.png", "test_accuracy.png"]


def plot_runs_to(tmp_path, runs, metrics, **kwargs):
    from dtx.tools.plots import plot_runs

    written = plot_runs(runs, str(tmp_path / "plots"), metrics, **kwargs)
    assert all(open(p, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for p in written)
    return written


def test_axes_carry_names_and_units():
    from dtx.tools.plots import X_AXES, axis_label

    assert axis_label("step_time_ms") == "time per training step (ms)"
    assert axis_label("examples_per_sec") == "throughput (examples/s, all devices)"
    assert axis_label("comm_bytes_per_step").endswith("(B)") and axis_label("my_delay_s") == "my_delay_s (s)"
    assert axis_label("my_score") == "my_score" and axis_label("perplexity").startswith("test perplexity")
    assert all("(" in label for x, (_, label) in X_AXES.items() if x != "step")  # every x axis but the step


def test_step_time_plots_mark_the_checkpoint_saves():
    from dtx.tools.plots import _panel

    runs = _runs_evaluated_at_the_end()
    runs["a"][1]["checkpoint_saved"] = [6, 8]
    one = _panel({"a": runs["a"]}, "step_time_ms", "step", {})
    assert one.marks == {"checkpoint saved (that step's time includes it)": [6, 8]}
    two = _panel(runs, "step_time_ms", "step", {})
    assert two.marks == {"a: checkpoint saved": [6, 8]} and two.mark_colors == {"a: checkpoint saved": "a"}
    assert _panel(runs, "loss", "step", {}).marks == {}  # the loss does not pay for a save


def test_plots_against_the_step_mark_each_elastic_restart():
    """`dtx launch --elastic` records a `membership` entry per start: every plot against the step marks each
    restart (not the first start) at the step it restored, naming its processes and mesh; time axes do not."""
    from dtx.tools.plots import _panel, restarts

    runs = _runs_evaluated_at_the_end()
    first = {"restart": 0, "processes": 2, "mesh": {"data": 4}, "grad_accum_steps": 1, "restored_step": 0}
    runs["a"][0]["membership"] = first
    runs["a"][1]["membership"] = {**first, "restart": 1, "processes": 1, "mesh": {"data": 2}, "grad_accum_steps": 2,
                                  "restored_step": 5}
    assert restarts(runs["a"]) == [(5, "restart 1: 1 process, data=2, accumulation 2")]
    one = _panel({"a": runs["a"]}, "loss", "step", {})
    assert one.marks == {"restart 1: 1 process, data=2, accumulation 2": [5]}
    two = _panel(runs, "step_time_ms", "step", {})
    assert two.marks["a: restart 1: 1 process, data=2, accumulation 2"] == [5]
    for record in runs["a"]:
        record["elapsed_s"] = float(record["step"])
    assert _panel({"a": runs["a"]}, "loss", "time", {}).marks == {}  # a restart is a step, not a moment


def test_marks_and_bars_draw_and_a_bad_kind_is_refused(tmp_path):
    import pytest

    from dtx.figures import Panel, panels_plot
    from dtx.tools.plots import _panel

    runs = _runs_evaluated_at_the_end()
    runs["b"][0]["checkpoint_saved"] = [4]
    panels = [_panel(runs, "step_time_ms", "step", {}), _panel(runs, "test_accuracy", "step", {})]
    assert open(panels_plot(panels, tmp_path / "two.png"), "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match=r"Panel\(kind='pie'\): choose one of lines, bars"):
        panels_plot([Panel({"a": ([1], [1])}, kind="pie")], tmp_path / "pie.png")
    assert not (tmp_path / "pie.png").exists()


def test_simulated_time_plots_name_the_cluster(tmp_path):
    from dtx.tools.plots import _panel, run_cluster

    runs = {name: [{"step": s, "loss": 1.0 / s, "sim_time_s": 0.1 * s} for s in (1, 2)] for name in ("a", "b")}
    same = _panel(runs, "loss", "sim_time", {"a": "haswell_fdr", "b": "haswell_fdr"})
    assert same.xlabel == "simulated time on haswell_fdr (s)" and "haswell_fdr" in same.title
    mixed = _panel(runs, "loss", "sim_time", {"a": "haswell_fdr", "b": "cloud_10gbe"})
    assert list(mixed.series) == ["a (haswell_fdr)", "b (cloud_10gbe)"]
    run = _run(tmp_path / "r", runs["a"])
    (tmp_path / "r" / "config.json").write_text(json.dumps({"cluster": {"name": "h100_nvlink_ndr"}}))
    assert run_cluster(run) == "h100_nvlink_ndr" and run_cluster(str(tmp_path)) == ""


def test_a_run_records_where_it_saved_checkpoints(tmp_path):
    """``checkpoint_saved`` sits in the record whose timing window holds the save (saves every 3 steps,
    records every 4: the record of step 4 holds the save of step 3, the last record steps 9 and 12)."""
    from dtx import config as config_lib
    from dtx.run import metrics
    from dtx.run.trainer import train
    from dtx.tools.plots import checkpoint_steps

    config = config_lib.load("digits_mlp", ["--config.num_steps=12", "--config.model.features=(16,)",
                                            "--config.log_every=4", "--config.progress=False",
                                            "--config.checkpoint.every_steps=3", "--config.checkpoint.async_save=False"])
    train(config, str(tmp_path / "run"))
    records = metrics.read_metrics(str(tmp_path / "run"))
    saved = {r["step"]: r["checkpoint_saved"] for r in records if "checkpoint_saved" in r}
    assert saved == {4: [3], 8: [6], 12: [9, 12]}
    assert all(r["checkpoint_save_s"] > 0 for r in records if "checkpoint_saved" in r)
    assert checkpoint_steps(records) == [3, 6, 9, 12]
