"""notebooks/quickstart.ipynb runs end to end (nbclient, a fresh kernel) in under five minutes.

The kernel starts in an empty temporary folder, not in the checkout: as on Colab after the install cell,
nothing may rely on the repository's files being there (experiments come from ``dtx.experiments``).
"""

import os

import nbclient  # the test extra installs it: pip install -e '.[test]'
import nbformat

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOK = os.path.join(REPO, "notebooks", "quickstart.ipynb")


def _text(cell):
    """What a cell printed and returned (not the progress bar it displayed, nor warnings on stderr)."""
    def shown(output):
        if output.output_type == "stream" and output.get("name") == "stderr":
            return ""
        if output.output_type != "execute_result":
            return output.get("text", "")
        return output["data"].get("text/markdown", output["data"].get("text/plain", ""))

    return "".join(shown(o) for o in cell.get("outputs", []))


def test_quickstart_notebook_runs_as_committed(tmp_path, monkeypatch):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert not any(cell.get("outputs") for cell in notebook.cells if cell.cell_type == "code"), \
        "commit the notebook without outputs"
    # dtx itself as an installed package provides it (a checkout run without installing: on the path).
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    # The kernel inherits this process's environment: JAX on the CPU, collectives that fail fast (conftest).
    nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()  # a hung cell fails at 300 s
    for cell in notebook.cells:  # where the time goes, for whoever makes the notebook longer
        times = cell.get("metadata", {}).get("execution", {})
        if "iopub.execute_input" in times:
            print(cell.source.splitlines()[0][:60], times["iopub.execute_input"], times.get("shell.execute_reply"))
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert "pip" in code[0].source and _text(code[0]).startswith("dtx: ")  # the install cell: dtx is there
    assert "8 devices: cpu" in _text(code[1])
    assert float(_text(code[2]).split("'test_accuracy': ")[1].split(",")[0]) >= 0.97  # the default experiment
    assert float(_text(code[4])) > 0.9  # your own ConvNet and optimizer
    warned = "".join(o.get("text", "") for o in code[4].outputs if o.get("name") == "stderr")
    assert "do nothing" not in warned and "RunWarning" not in warned, warned  # the example heeds its own warning
    table = _text(code[5])
    for run in ("baseline", "bf16", "ring", "topk-5%", "powersgd-r2", "local_sgd-H4"):
        assert f"| {run} |" in table
    assert "per layer at 128 nodes" in _text(code[7]) and "run the 128-node plan" in _text(code[7])  # the tables
    piped = {line.split("|")[1].strip(): line.split("|")[2].strip() for line in _text(code[8]).splitlines()
             if line.startswith("| ")}  # run -> test accuracy: the pipeline computes what the baseline does
    assert "stage 1:" in _text(code[8]) and piped["pipeline-1f1b"] == piped["baseline"]
    assert not any("ROOT" in cell.source or "experiments/" in cell.source for cell in code)  # no checkout assumed
    assert list(tmp_path.iterdir()) == []  # the runs went to a temporary folder of their own
    images = [o for cell in code[7:] for o in cell.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # the simulator's speedup plot, loss vs steps, loss vs bytes
