"""``dtx simulate``: speedup per node count as JSON and tables, files only when asked, bad input exits 2 naming the fix."""
import json
import os
import re

import pytest

from dtx.tools.simulate import simulate_main


def test_simulate_json_reports_speedup_per_node_count(tmp_path, capsys):
    argv = ["--model", "vgg_a", "--global-batch", "512", "--nodes", "1,2,4,8,16,32,64,128", "--node-flops", "2.3e12",
            "--memory-bandwidth", "1.36e11", "--bandwidth", "6.8e9", "--latency", "2e-6", "--out", str(tmp_path),
            "--json"]
    assert simulate_main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    speedup = result["speedup"]
    assert list(speedup) == ["1", "2", "4", "8", "16", "32", "64", "128"]
    assert speedup["1"] == pytest.approx(1) and all(speedup[k] <= int(k) for k in speedup)
    assert 60 < speedup["128"] < 128  # Das et al. §5 measure 90x for VGG-A at 128 nodes, batch 512
    last = result["points"][-1]
    assert last["mesh"] == [["data", 128 // last["group_size"]], ["model", last["group_size"]]]
    assert last["rules"][-1] == [".*", []] and ["^fc6/kernel$", [None, "model"]] in last["rules"]
    assert [row["layer"] for row in result["layers"]][-3:] == ["fc6", "fc7", "fc8"]
    assert os.path.getsize(result["plot"]) > 0 and result["plot"].startswith(str(tmp_path))


def test_simulate_table_with_a_preset(tmp_path, capsys):
    argv = ["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--per-node-batch", "16", "--nodes", "1,4,16",
            "--overlap", "ideal", "--plan", "hybrid", "--out", str(tmp_path)]
    assert simulate_main(argv) == 0
    out = capsys.readouterr().out
    assert "weak scaling, 16 per node" in out and "G=" in out and "fc7" in out
    assert (tmp_path / "simulate_speech_dnn_cloud_10gbe_nodes-1-4-16_per-node-batch-16_overlap-ideal_plan-hybrid.png"
            ).exists()


def test_two_commands_into_one_folder_never_overwrite_each_other(tmp_path, capsys):
    """The README's two commands once wrote the same simulate_vgg_a_haswell_fdr.png, the second silently
    replacing the first: the name carries the node list and every setting away from its default."""
    common = ["--model", "speech_dnn", "--cluster", "haswell_fdr", "--out", str(tmp_path)]
    assert simulate_main(common + ["--nodes", "1,2,4,8"]) == 0
    assert simulate_main(common + ["--nodes", "2,4,8"]) == 0
    assert simulate_main(common + ["--nodes", "2,4,8", "--global-batch", "256"]) == 0
    assert simulate_main(common + ["--nodes", "2,4,8", "--algorithm", "tree"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "simulate_speech_dnn_haswell_fdr_nodes-1-2-4-8_batch-512.png",
        "simulate_speech_dnn_haswell_fdr_nodes-2-4-8_batch-256.png",
        "simulate_speech_dnn_haswell_fdr_nodes-2-4-8_batch-512.png",
        "simulate_speech_dnn_haswell_fdr_nodes-2-4-8_batch-512_algorithm-tree.png"]


def test_the_python_study_prints_the_commands_tables_and_plots(tmp_path, capsys):
    from dtx.perf import report

    argv = ["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--nodes", "1,4,16", "--global-batch", "256"]
    assert simulate_main(argv) == 0
    printed = capsys.readouterr().out
    assert simulate_main(argv + ["--json"]) == 0
    speedup = json.loads(capsys.readouterr().out)["speedup"]
    study = report.simulate("speech_dnn", "cloud_10gbe", [1, 4, 16], global_batch=256)
    assert printed.startswith(str(study) + "\n") and repr(study) == str(study)
    assert "fc7" in str(study) and "run the 16-node plan: dtx train EXPERIMENT.py --config.mesh=" in str(study)
    assert [p.speedup for p in study.points] == [speedup[k] for k in ("1", "4", "16")]
    nodes, predicted = study.speedups()[f"predicted, overlap={study.overlap}"]
    assert nodes == [1, 4, 16] and predicted == pytest.approx([p.speedup for p in study.points], rel=1e-12)
    path = study.plot(tmp_path)
    assert path == str(tmp_path / "simulate_speech_dnn_cloud_10gbe_nodes-1-4-16_batch-256.png")
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="unknown cluster preset 'nope'"):
        report.simulate("speech_dnn", "nope", [1, 2])


def test_simulate_writes_no_file_unless_asked(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert simulate_main(["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--nodes", "1,4"]) == 0
    assert "pass --out DIR to save the speedup plot" in capsys.readouterr().out
    assert simulate_main(["--model", "speech_dnn", "--cluster", "cloud_10gbe", "--nodes", "1,4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plot"] is None
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, message", [
    (["--model", "alexnet", "--cluster", "haswell_fdr"], r"unknown model 'alexnet'.*vgg_a"),
    (["--model", "vgg_a", "--cluster", "nope"], r"unknown cluster preset 'nope'"),
    (["--model", "vgg_a", "--node-flops", "2.3e12"], r"without --cluster, give --memory-bandwidth, --bandwidth, "
                                                     r"--latency"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--bandwidth", "-5"], r"--bandwidth: must be a positive"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "1,two"], r"--nodes: expected comma-separated"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "1,3"], r"global batch 512 does not split evenly "
                                                                          r"over 3 nodes"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--group-size", "3", "--nodes", "1,2,4"],
     r"group size 3 does not divide the 2 nodes of the \(data, model\) mesh; choose one of \[1, 2\]"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--nodes", "4", "--group-size", "8"],
     r"group size 8 does not divide the 4 nodes"),
    (["--model", "mlp", "--cluster", "haswell_fdr"], r"no default input shape; pass --input-shape"),
    (["--model", "vgg_a", "--cluster", "haswell_fdr", "--efficiency", "gpu=0.5"], r"unknown layer kind 'gpu'"),
])
def test_simulate_bad_input_exits_2_naming_the_fix(argv, message, capsys, tmp_path):
    assert simulate_main(argv + ["--out", str(tmp_path)]) == 2
    assert re.search(message, capsys.readouterr().err, flags=re.S)
