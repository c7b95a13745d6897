"""The ``dtx`` command line (dtx.tools.cli): it parses and calls, and every mistake is one line naming the fix
with exit status 2. Nothing here trains or compiles."""
import re

import pytest

from dtx.tools.cli import main


def test_bench_alone_lists_its_commands(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^  collectives +time every allreduce", out, re.M) and re.search(r"^  step +split", out, re.M)
    assert main(["bench"]) == 2 and "  collectives" in capsys.readouterr().err
    assert main(["bench", "stpe"]) == 2
    assert "unknown command 'stpe'; choose from collectives, step" in capsys.readouterr().err


def test_train_refuses_unknown_arguments_and_keys_naming_the_override_form(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "digits_mlp", "--learning-rate=0.1"])
    assert exit_.value.code == 2
    assert "unrecognised arguments: --learning-rate=0.1 (config overrides are --config.KEY=VALUE)" in (
        capsys.readouterr().err)
    assert main(["train", "digits_mlp", "--config.nope=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtx: config error:") and "nope" in err and len(err.strip().splitlines()) == 1


def test_every_command_is_listed_and_dispatched_to_its_module(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    for command in ("train", "launch", "simulate", "plot", "eval", "export", "bench collectives", "bench step"):
        assert re.search(rf"^\s+{command}\s", out, re.M), command
    assert main(["simulate", "--model", "nope", "--cluster", "haswell_fdr"]) == 2  # reached dtx.tools.simulate
    assert "unknown model 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("features", ['("a",)', "(2.5,)", "(None,)", "(True,)", "(64, True)"])
def test_widths_of_the_wrong_type_are_one_config_error(features, tmp_path, capsys):
    """They reached flax as a shape (a 40-line traceback), or, True, silently trained a width-1 MLP."""
    assert main(["train", "digits_mlp", "--workdir", str(tmp_path), f"--config.model.features={features}"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("dtx: config error: model.features=") and len(err.strip().splitlines()) == 1
    assert "must be a tuple of integers (widths or sizes), e.g. --config.model.features='(256, 256)'" in err


def test_a_workdir_under_a_file_is_one_error(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    assert main(["train", "digits_mlp", "--workdir", str(tmp_path / "file" / "sub")]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"dtx: error: --workdir (train(..., workdir=)) '{tmp_path}/file/sub' cannot be "
                           f"created: '{tmp_path}/file' is a file, not a directory; name a directory")


def test_an_experiment_file_that_is_not_text_is_one_config_error(tmp_path, capsys):
    """Random bytes (no UTF-8, no coding declaration) ended in a 17-line UnicodeDecodeError traceback."""
    noise = tmp_path / "noise.py"
    noise.write_bytes(bytes(range(128, 256)) * 4)
    assert main(["train", str(noise), "--workdir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"dtx: config error: {noise}, line 1: byte 0x80 is not valid utf-8")
