"""dtx owns no top-level name but ``dtx``: a user's own ``models`` and ``experiments`` packages stay theirs.

The repository keeps ``models/`` and ``experiments/`` beside ``dtx/``; they are reached as
``dtx.models`` and ``dtx.experiments`` in all three ways dtx is run: from a checkout nobody
installed (``dtx/_checkout.py``), after ``pip install -e .`` (setuptools' editable finder) and after
``pip install .`` (the files copied inside ``dtx/``, laid out here by setuptools' own ``build_py``
from pyproject.toml, offline). Each way runs a user's script from a folder that holds the user's
``models`` and ``experiments`` packages: the user's modules are the ones the user imports, and dtx
still builds its models and trains a packaged experiment by its bare name.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from dtx import config as config_lib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

USER_FILES = {
    # No build_model here: a dtx that imported the top-level `models` would fail on it.
    "models/__init__.py": 'OWNER = "user"\n',
    "experiments/__init__.py": 'OWNER = "user"\n',
    # The user's own experiment of the same name as a packaged one: a path reaches the user's file.
    "experiments/digits_mlp.py": textwrap.dedent("""\
        from dtx.config import base_config

        def get_config():
            config = base_config()
            config.num_steps = 7
            return config
        """),
    "user_script.py": textwrap.dedent("""\
        import json
        import sys

        if sys.argv[1] == "checkout":  # a checkout nobody installed: no installer's finder may help
            sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
        import experiments  # the user's, imported before dtx

        import dtx
        dtx_imported_models = "models" in sys.modules
        import models  # the user's, imported after dtx
        import dtx.experiments
        from dtx.tools import cli
        from dtx.models import build_model

        status, last = None, {}
        if sys.argv[2] == "train":  # a packaged experiment by its bare name, through the command line
            status = cli.main(["train", "digits_mlp", "--workdir", "run", "--config.num_steps=2",
                               "--config.progress=False", "--config.emulate_cpu_devices=8"])
            with open("run/metrics.jsonl") as f:
                last = [json.loads(line) for line in f][-1]
        print(json.dumps(dict(
            status=status, last=last, owners=[models.OWNER, experiments.OWNER], dtx_imported_models=dtx_imported_models,
            user=[models.__file__, experiments.__file__],
            dtx=[dtx.__file__, sys.modules["dtx.models"].__file__, sys.modules["dtx.experiments"].__file__],
            lenet=type(build_model("lenet")).__module__,
            user_experiment=dtx.load("experiments/digits_mlp.py").num_steps,
            local_sgd=dtx.load("sync_strategies:local_sgd").strategy.name,
            top_level=sorted(name for name in sys.modules if name.split(".")[0] in ("models", "experiments")))))
        """),
}


def _installed_layout(target):
    """What ``pip install .`` puts in site-packages, by setuptools' own build step (reads pyproject.toml)."""
    subprocess.run([sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "build_py",
                    "--build-lib", str(target)], cwd=REPO, check=True, capture_output=True, timeout=120)
    assert os.path.isfile(target / "dtx" / "models" / "mlp.py")
    assert not os.path.exists(target / "models") and not os.path.exists(target / "experiments")
    return target


# Training costs ~6 s a run; the import of dtx.run.trainer (which builds its models) is in every mode, the
# end-to-end run in the one a user without a checkout has.
@pytest.mark.parametrize("mode, train", [("checkout", False), ("editable", False), ("installed", True)])
def test_user_packages_named_models_and_experiments_stay_the_users(mode, train, tmp_path):
    user = tmp_path / "project"
    for name, text in USER_FILES.items():
        (user / name).parent.mkdir(parents=True, exist_ok=True)
        (user / name).write_text(text)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if mode == "checkout":
        env["PYTHONPATH"] = REPO  # after the script's folder: the user's packages come first on sys.path
        dtx_root = REPO
    elif mode == "installed":
        env["PYTHONPATH"] = str(_installed_layout(tmp_path / "site"))
        dtx_root = str(tmp_path / "site" / "dtx")
    else:  # the test environment's own `pip install -e .`, found from a folder outside the checkout
        dtx_root = REPO
    done = subprocess.run([sys.executable, "user_script.py", mode, "train" if train else "import"], cwd=user, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])

    assert seen["owners"] == ["user", "user"] and not seen["dtx_imported_models"]
    assert seen["user"] == [str(user / "models" / "__init__.py"), str(user / "experiments" / "__init__.py")]
    assert seen["top_level"] == ["experiments", "models"]  # dtx imported no module of the user's packages
    assert all(path.startswith(dtx_root) for path in seen["dtx"]), seen["dtx"]
    if mode == "installed":
        assert seen["dtx"][1] == str(tmp_path / "site" / "dtx" / "models" / "__init__.py")
    assert seen["lenet"] == "dtx.models.lenet"
    if train:
        assert seen["status"] == 0 and seen["last"]["step"] == 2 and 0 <= seen["last"]["test_accuracy"] <= 1
    assert seen["user_experiment"] == 7  # a path is the user's file, a bare name the packaged one
    assert seen["local_sgd"] == "local_sgd"  # a packaged experiment importing another one


def test_bare_names_resolve_to_packaged_experiments_and_a_miss_lists_them(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    names = config_lib.packaged_experiments()
    assert {"digits_mlp", "digits_lenet", "sync_strategies"} <= set(names)
    assert config_lib.load("digits_lenet").model.name == "lenet"
    assert config_lib.load("large_batch:lars", ["--config.num_epochs=1"]).optimizer.name == "lars"
    with pytest.raises(config_lib.ConfigError, match=r"'digits_mpl' not found .* ships with dtx: .*digits_mlp"):
        config_lib.load("digits_mpl")
    (tmp_path / "digits_lenet").mkdir()  # a folder of that name is not an experiment file: still packaged
    assert config_lib.load("digits_lenet").model.name == "lenet"
