"""Your own parts by import path (dtx.config.parts): a user's package on sys.path names its model class, task
function and data function in the config; the fields and parameters become settings checked at load; the
command line trains, evaluates, exports and plans such a run; what cannot be rebuilt is listed in one error.

The package (``userpkg``) lives in a temporary folder: a BatchNorm CNN in plain flax, a focal loss, a data
source of blobs, and some parts dtx must refuse.
"""

import importlib.util
import json
import sys
import textwrap

import jax
import numpy as np
import pytest

import dtx
from dtx import config as config_lib
from dtx.data import tasks as tasks_lib
from dtx.run import evaluate, metrics
from dtx.tools.cli import main

CNN = textwrap.dedent('''
    """A BatchNorm CNN in plain flax (no dtx import: an export copies this file)."""
    from typing import Any, Sequence

    import flax.linen as nn
    import jax.numpy as jnp


    class SmallCNN(nn.Module):
        features: Sequence[int] = (4,)
        hidden: int = 16
        num_classes: int = 10
        dtype: Any = jnp.float32
        param_dtype: Any = jnp.float32
        norm_axis_name: Any = None

        @nn.compact
        def __call__(self, x, train: bool = False):
            for width in self.features:
                x = nn.Conv(width, (3, 3), dtype=self.dtype, param_dtype=self.param_dtype)(x)
                x = nn.BatchNorm(use_running_average=not train, axis_name=self.norm_axis_name if train else None)(x)
                x = nn.relu(x)
            x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, param_dtype=self.param_dtype)(x.reshape(len(x), -1)))
            return nn.Dense(self.num_classes, dtype=self.dtype, param_dtype=self.param_dtype)(x)


    class Plain(nn.Module):
        """No dtype fields: it computes in float32 whatever the policy says."""
        width: int = 8
        label: Any = None

        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(4)(x.reshape(len(x), -1))


    class Required(nn.Module):
        width: int

        def __call__(self, x, train: bool = False):
            return x


    NOT_A_MODEL = 3
''')

PARTS = textwrap.dedent('''
    """A focal loss and a data source."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dtx.data.tasks import Task


    def focal_loss(gamma: float = 2.0):
        def loss(logits, labels):
            log_p = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32)), labels[:, None], -1)[:, 0]
            return -((1 - jnp.exp(log_p)) ** gamma) * log_p

        def metrics(logits, labels):
            return {"accuracy": jnp.argmax(logits, -1) == labels}

        return Task("focal", loss, metrics)


    def not_a_task():
        return "focal"


    def blobs(num_train: int = 256, noise: float = 0.5, seed: int = 0):
        rng = np.random.default_rng(seed)
        centers = rng.normal(size=(4, 8, 8, 1)).astype(np.float32)

        def draw(n):
            labels = rng.integers(0, 4, n).astype(np.int32)
            return centers[labels] + noise * rng.normal(size=(n, 8, 8, 1)).astype(np.float32), labels

        return {"train": draw(num_train), "test": draw(64), "num_classes": 4}
''')

MODEL, TASK, DATA = "userpkg.cnn:SmallCNN", "userpkg.parts:focal_loss", "userpkg.parts:blobs"
RUN = [f"--config.model.name={MODEL}", f"--config.task.name={TASK}", "--config.task.gamma=1.0",
       f"--config.dataset.name={DATA}", "--config.dataset.noise=0.3", "--config.num_steps=8",
       "--config.global_batch_size=64", "--config.eval_batch_size=64", "--config.log_every=4",
       "--config.checkpoint.every_steps=8", "--config.progress=False"]


@pytest.fixture(scope="module")
def package(tmp_path_factory):
    """The folder holding ``userpkg``, on sys.path for this module's tests."""
    root = tmp_path_factory.mktemp("userparts")
    (root / "userpkg").mkdir()
    (root / "userpkg" / "__init__.py").write_text("")
    (root / "userpkg" / "cnn.py").write_text(CNN)
    (root / "userpkg" / "parts.py").write_text(PARTS)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in [n for n in sys.modules if n == "userpkg" or n.startswith("userpkg.")]:
        del sys.modules[name]


def load(*overrides):
    return config_lib.load("digits_mlp", list(overrides))


# ------------------------------------------------------------------ settings at load time


def test_a_model_class_by_import_path_brings_its_fields_as_the_blocks_settings(package):
    config = load(f"--config.model.name={MODEL}", "--config.model.hidden=32", "--config.model.features=(2, 3)")
    # dtx's own fields (num_classes, dtype, param_dtype, norm_axis_name) are not settings: dtx fills them.
    assert config.model.to_dict() == {"name": MODEL, "features": (2, 3), "hidden": 32}
    with pytest.raises(config_lib.ConfigError, match=r"model\.hidden.*wrong type"):
        load(f"--config.model.name={MODEL}", "--config.model.hidden=3.5")
    with pytest.raises(config_lib.ConfigError, match=r"unknown config key 'model\.hiden' \(did you mean 'hidden'\?\)"
                                                     r".*chose a model that does not take it \(its settings: "
                                                     r"features, hidden\)"):
        load(f"--config.model.name={MODEL}", "--config.model.hiden=3")
    # Your model's integers are its own business: dtx's "widths >= 1" rule is for its models.
    assert load(f"--config.model.name={MODEL}", "--config.model.hidden=0").model.hidden == 0
    with pytest.raises(config_lib.ConfigError, match=r"model\.features=\(0,\).*>= 1"):
        load("--config.model.features=(0,)")


def test_a_model_name_replaces_the_block_with_that_models_defaults(package):
    from dtx.models import model_fields

    config = load("--config.model.name=lenet", "--config.model.conv_features=(8, 16)")
    assert config.model.to_dict() == {**model_fields("lenet"), "name": "lenet", "conv_features": (8, 16)}
    # The order on the command line does not matter; the name applies first.
    assert load("--config.model.conv_features=(8, 16)", "--config.model.name=lenet") == config
    with pytest.raises(config_lib.ConfigError, match=r"'model\.features'.*--config\.model\.name=lenet chose a model "
                                                     r"that does not take it \(its settings: conv_features, "
                                                     r"dense_features, use_batch_norm\)"):
        load("--config.model.name=lenet", "--config.model.features=(8,)")
    # The Python twin does the same; the same name again keeps the experiment's settings.
    assert dtx.override(load(), **{"model.conv_features": (8, 16), "model.name": "lenet"}) == config
    narrow = dtx.override(load(), **{"model.features": (32,)})
    assert dtx.override(narrow, **{"model.name": "mlp"}).model.features == (32,)


def test_an_experiment_that_renames_its_model_without_replacing_the_block_is_told_how(package, tmp_path):
    (tmp_path / "renamed.py").write_text(textwrap.dedent('''
        from dtx.config import base_config

        def get_config():
            config = base_config()
            config.model.name = "lenet"
            return config
    '''))
    with pytest.raises(config_lib.ConfigError, match=r"model 'lenet' has no setting 'features'.*"
                                                     r"--config\.model\.name=lenet .*replaces the block with that "
                                                     r"model's defaults.*config\.model = ConfigDict"):
        config_lib.load(str(tmp_path / "renamed.py"))


def test_a_task_and_a_data_function_by_import_path_bring_their_parameters(package):
    config = load(f"--config.task.name={TASK}", "--config.task.gamma=0.5", f"--config.dataset.name={DATA}",
                  "--config.dataset.num_train=128")
    assert config.task.gamma == 0.5 and config.dataset.num_train == 128 and config.dataset.noise == 0.5
    assert "seed" not in config.dataset  # dtx gives the function config.seed
    assert tasks_lib.task_settings(TASK)[TASK] == ("gamma",)
    with pytest.raises(config_lib.ConfigError, match=r"task\.pad_id=0 applies to task\.name=next_token only, not "
                                                     rf"{TASK} \(task '{TASK}' takes: gamma\)"):
        load(f"--config.task.name={TASK}", "--config.task.pad_id=0")
    with pytest.raises(config_lib.ConfigError, match=rf"dataset\.data_dir='x' does not reach dataset\.name='{DATA}', "
                                                     r"which takes num_train, noise"):
        load(f"--config.dataset.name={DATA}", "--config.dataset.data_dir=x")
    with pytest.raises(config_lib.ConfigError, match=r"'task\.gama' \(did you mean 'gamma'\?\)"):
        load(f"--config.task.name={TASK}", "--config.task.gama=1.0")
    with pytest.raises(tasks_lib.TaskError, match=r"returned str, not a dtx\.data\.tasks\.Task"):
        tasks_lib.make_task("userpkg.parts:not_a_task")


@pytest.mark.parametrize("override, message", [
    ("model.name=userpkg.cnn:SmalCNN", r"userpkg\.cnn \(.*cnn\.py\) has no 'SmalCNN' \(did you mean "
                                      r"userpkg\.cnn:SmallCNN\?\)"),
    ("model.name=userpkg.nowhere:Net", r"cannot import 'userpkg\.nowhere'.*PYTHONPATH"),
    ("model.name=userpkg.cnn:NOT_A_MODEL", r"is int 3, not a flax\.linen\.Module class"),
    ("model.name=userpkg.cnn:Required", r"Required has setting\(s\) \['width'\] without a default"),
    ("model.name=userpkg.cnn:", r"is not an import path; write package\.module:Name"),
    ("task.name=userpkg.parts:focal", r"has no 'focal' \(did you mean userpkg\.parts:focal_loss\?\)"),
    ("dataset.name=nowhere_at_all:blobs", r"cannot import 'nowhere_at_all'"),
])
def test_a_part_that_cannot_be_found_is_named_at_load_with_the_fix(package, override, message):
    with pytest.raises(config_lib.ConfigError, match=rf"{override.split('=')[0]}=.*{message}"):
        load(f"--config.{override}")


def test_a_model_without_dtype_fields_refuses_another_precision(package):
    from dtx.models import build_model

    assert build_model("userpkg.cnn:Plain", num_classes=4, dtype=np.float32).width == 8
    # A field whose default is None has no type the command line can parse by; Python can still set it.
    with pytest.raises(config_lib.ConfigError, match=r"'model\.label' has the default None.*dtx\.override"):
        load("--config.model.name=userpkg.cnn:Plain", "--config.model.label=x")
    assert dtx.override(load("--config.model.name=userpkg.cnn:Plain"), **{"model.label": "x"}).model.label == "x"
    with pytest.raises(config_lib.ConfigError, match=r"no field 'dtype'.*bfloat16 cannot reach its layers"):
        build_model("userpkg.cnn:Plain", dtype="bfloat16")


# ------------------------------------------------------------------ the command line: train, eval, export, plan


@pytest.fixture(scope="module")
def run(package, tmp_path_factory):
    """One run of the user's model, task and data, trained through the CLI with checkpoints."""
    workdir = tmp_path_factory.mktemp("userrun") / "run"
    assert main(["train", "digits_mlp", "--workdir", str(workdir), *RUN]) == 0
    return workdir


def test_eval_and_export_rebuild_the_run_from_its_config(run, tmp_path, capsys):
    saved = json.loads((run / "config.json").read_text())
    assert saved["model"] == {"name": MODEL, "features": [4], "hidden": 16}
    assert saved["task"]["gamma"] == 1.0 and saved["dataset"]["noise"] == 0.3
    final = metrics.read_metrics(run)[-1]
    capsys.readouterr()
    assert main(["eval", str(run)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed == {"step": 8, **{k: final[k] for k in ("test_accuracy", "test_loss", "test_examples")}}
    assert final["test_examples"] == 64  # the blobs' test split, not digits'

    out = tmp_path / "exported"
    assert main(["export", str(run), "--out", str(out)]) == 0
    described = json.loads((out / "model.json").read_text())
    assert described["class"] == "userpkg.cnn.SmallCNN" and described["source"] == "model.py"
    assert described["kwargs"]["num_classes"] == 4 and described["kwargs"]["hidden"] == 16
    # The copied file, loaded apart from the package, gives the restored model's logits.
    spec = importlib.util.spec_from_file_location("exported_cnn", out / "model.py")
    source = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(source)
    import flax.serialization

    variables = flax.serialization.msgpack_restore((out / "variables.msgpack").read_bytes())
    restored = evaluate.restore(run)
    inputs = np.asarray(restored.dataset.test.inputs[:8])
    expected = restored.parts.model.apply(jax.device_get({"params": restored.state.params,
                                                          **restored.state.model_state}), inputs, train=False)
    got = source.SmallCNN(**described["kwargs"]).apply(variables, inputs, train=False)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_simulate_plans_a_model_given_by_import_path(package, capsys):
    from dtx.models import build_model
    from dtx.tools.simulate import simulate_main

    assert simulate_main(["--model", MODEL, "--input-shape", "8,8,1", "--cluster", "haswell_fdr", "--nodes", "1,2",
                          "--json"]) == 0
    layers = {r["layer"]: r["weights"] for r in json.loads(capsys.readouterr().out)["layers"]}
    params = build_model(MODEL).init(jax.random.PRNGKey(0), np.zeros((1, 8, 8, 1), np.float32))["params"]
    # Every kernel of the user's model, planned with its own shape (BatchNorm is not a planned layer).
    assert layers == {name: sum(int(np.prod(p[k].shape)) for k in ("kernel", "bias"))
                      for name, p in params.items() if "kernel" in p}
    assert simulate_main(["--model", MODEL, "--cluster", "haswell_fdr"]) == 2
    assert "has no default input shape; pass --input-shape" in capsys.readouterr().err


def test_a_run_that_cannot_be_rebuilt_lists_every_missing_part_at_once(package, tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model": {"given": "dtx.train(model=...)", "class": "userpkg.cnn.SmallCNN", "fields": {}},
        "task": {"name": "gone_pkg:focal"},
        "dataset": {"given": "dtx.train(data=...)", "fingerprint": "0123abcd", "description": None},
    }))
    with pytest.raises(evaluate.RunError) as e:
        evaluate.evaluate_run(tmp_path)
    text = str(e.value)
    assert "needs 3 part(s)" in text and text.index("(1) the model") < text.index("(2) task.name='gone_pkg:focal'") \
        < text.index("(3) the data")
    assert "--config.model.name=userpkg.cnn:SmallCNN" in text  # the way to make it rebuildable from the shell
    assert "evaluate_run(" in text and "model=..., data=..." in text
    assert main(["eval", str(tmp_path)]) == 2
    assert "needs 3 part(s)" in capsys.readouterr().err


def test_a_module_in_the_current_folder_imports_without_pythonpath(tmp_path, monkeypatch):
    """`dtx` is a console script: the folder it runs in is not on sys.path, yet a file there is found."""
    (tmp_path / "beside_cmd.py").write_text("import flax.linen as nn\n\n\nclass Net(nn.Module):\n    width: int = 3\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    try:
        assert load("--config.model.name=beside_cmd:Net").model.to_dict() == {"name": "beside_cmd:Net", "width": 3}
    finally:
        sys.modules.pop("beside_cmd", None)
