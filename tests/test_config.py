"""Tests for dtx.config: the locked base config, experiment files, overrides and validation."""
import copy
import os
import re
import sys
import textwrap

import pytest
from ml_collections import ConfigDict

import dtx
from dtx.config import ConfigError, base_config, load, override, validate
from dtx.step import DRIVERS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DIGITS = os.path.join(REPO, "experiments", "digits_mlp.py")


@pytest.fixture(autouse=True)
def plain_sys_argv(monkeypatch):
    """load() takes its overrides as an argument; pytest's own argv must play no part."""
    monkeypatch.setattr(sys, "argv", ["pytest"])


def _experiment(tmp_path, body):
    path = tmp_path / "experiment.py"
    path.write_text(
        "from dtx.config import base_config\n\n\ndef get_config():\n    config = base_config()\n"
        + textwrap.indent(textwrap.dedent(body), "    ")
        + "    return config\n"
    )
    return str(path)


# -------------------------------------------------------------- base_config

def test_base_config_is_locked_against_new_keys():
    config = base_config()
    assert config.is_locked
    with pytest.raises(AttributeError, match="learning_rat"):
        config.learning_rat = 0.1
    with pytest.raises(AttributeError, match="learning_rat"):
        config.optimizer.learning_rat = 0.1
    assert "learning_rat" not in config and "learning_rat" not in config.optimizer
    config.num_steps = 3  # existing keys stay writable
    assert config.num_steps == 3


def test_base_config_is_typed_and_fresh_per_call():
    config = base_config()
    with pytest.raises(TypeError, match="num_steps"):
        config.num_steps = "ten"
    config.model.features = (1,)
    assert base_config().model.features == (256, 256)  # no shared state between calls
    validate(base_config())  # the default itself is valid


# ----------------------------------------------------------------------- load

def test_load_digits_mlp_returns_the_documented_values(monkeypatch):
    monkeypatch.chdir(REPO)
    config = load("experiments/digits_mlp.py")  # the path the experiment's docstring uses
    assert isinstance(config, ConfigDict) and config.is_locked
    assert config.dataset.name == "digits"
    assert config.model.name == "mlp" and config.model.features == (256, 256)
    assert config.optimizer.name == "adam"
    assert config.optimizer.learning_rate == 2e-3
    assert config.global_batch_size == 128
    assert config.num_epochs == 20.0 and config.num_steps == 0
    assert config.driver == "shard_map"
    assert config.mesh == (("data", -1),)
    assert config.emulate_cpu_devices == 8
    # Keys the experiment does not touch keep the base defaults.
    base = base_config()
    for key in ("seed", "eval_batch_size", "log_every", "eval_every"):
        assert config[key] == base[key]
    assert config.optimizer.momentum == base.optimizer.momentum
    with pytest.raises(AttributeError):
        config.new_key = 1


def test_load_applies_overrides():
    config = load(DIGITS, [
        "--config.driver=jit",
        "--config.model.features=(64,)",
        "--config.num_steps=5",
        "--config.optimizer.learning_rate=0.01",
    ])
    assert config.driver == "jit"
    assert config.model.features == (64,)
    assert config.num_steps == 5 and type(config.num_steps) is int
    assert config.optimizer.learning_rate == 0.01 and type(config.optimizer.learning_rate) is float
    # Untouched keys keep the experiment's values.
    assert config.global_batch_size == 128 and config.optimizer.name == "adam"


def test_overrides_come_from_the_argument_not_sys_argv(monkeypatch):
    # The CLI's argv holds other flags; the API must apply exactly the overrides it is given.
    monkeypatch.setattr(sys, "argv", ["dtx", "train", DIGITS, "--config.num_steps=99"])
    config = load(DIGITS, ["--config.num_steps=5", "--config.driver=jit"])
    assert (config.num_steps, config.driver) == (5, "jit"), (
        "dtx.config.load must apply its `overrides` argument, whatever sys.argv holds"
    )


def test_int_override_of_a_float_key_is_coerced():
    config = load(DIGITS, ["--config.optimizer.learning_rate=1"])
    assert config.optimizer.learning_rate == 1.0
    assert type(config.optimizer.learning_rate) is float
    config = load(DIGITS, ["--config.num_epochs=3"])
    assert config.num_epochs == 3.0 and type(config.num_epochs) is float


def test_override_prefix_is_optional_and_overrides_do_not_leak():
    config = load(DIGITS, ["num_steps=7", "--model.features=(32,16)"])
    assert config.num_steps == 7
    assert config.model.features == (32, 16)
    fresh = load(DIGITS)  # a later load starts from the file again
    assert fresh.num_steps == 0 and fresh.model.features == (256, 256)


def test_mesh_override():
    config = load(DIGITS, ["--config.mesh=(('data', 4), ('model', 2))"])
    assert config.mesh == (("data", 4), ("model", 2))


def test_unknown_top_level_key_is_named():
    with pytest.raises(ConfigError, match=r"(?i)unknown config key.*learning_rat"):
        load(DIGITS, ["--config.learning_rat=0.1"])


def test_unknown_nested_key_suggests_the_right_one():
    with pytest.raises(ConfigError, match=r"(?is)optimizer\.learning_rat\b.*did you mean.*learning_rate"):
        load(DIGITS, ["--config.optimizer.learning_rat=0.1"])


@pytest.mark.parametrize("value", ["abc", "1.5"])
def test_wrongly_typed_override_names_the_key_and_value(value):
    with pytest.raises(ConfigError, match=rf"num_steps={value}\b") as e:
        load(DIGITS, [f"--config.num_steps={value}"])
    assert "int" in str(e.value)  # says what type was expected


def test_override_values_are_validated():
    with pytest.raises(ConfigError, match=r"driver='foo' is unknown.*'shard_map', 'jit'"):
        load(DIGITS, ["--config.driver=foo"])
    with pytest.raises(ConfigError, match=r"global_batch_size=0 must be >= 1"):
        load(DIGITS, ["--config.global_batch_size=0"])


def test_missing_experiment_file_is_named(tmp_path):
    missing = str(tmp_path / "nope" / "missing.py")
    with pytest.raises(ConfigError, match=rf"{re.escape(repr(missing))}.*not found"):
        load(missing)
    # A ":arg" suffix is not part of the file name.
    with pytest.raises(ConfigError, match=rf"{re.escape(repr(missing))}.*not found"):
        load(missing + ":small")


def test_experiment_file_is_loaded_with_its_changes(tmp_path):
    path = _experiment(tmp_path, """
        config.num_steps = 3
        config.model.features = (8,)
    """)
    config = load(path)
    assert config.num_steps == 3 and config.model.features == (8,)


def test_experiment_file_with_a_wrongly_typed_value_fails_at_load(tmp_path):
    path = _experiment(tmp_path, 'config.num_steps = "ten"\n')
    with pytest.raises(ConfigError, match=r"num_steps") as e:
        load(path)
    assert path in str(e.value)  # says which file


def test_experiment_file_with_a_misspelt_key_fails_at_load(tmp_path):
    path = _experiment(tmp_path, "config.num_step = 3\n")
    with pytest.raises(ConfigError, match=r"num_step\b") as e:
        load(path)
    assert "did you mean" in str(e.value).lower() and "num_steps" in str(e.value)


def test_experiment_file_must_return_a_config_dict(tmp_path):
    path = tmp_path / "plain.py"
    path.write_text("def get_config():\n    return {'num_steps': 3}\n")
    with pytest.raises(ConfigError, match=r"get_config\(\) must return an ml_collections\.ConfigDict"):
        load(str(path))


def test_experiment_values_are_validated(tmp_path):
    path = _experiment(tmp_path, 'config.driver = "pmap"\n')
    with pytest.raises(ConfigError, match=r"driver='pmap'"):
        load(path)


# ------------------------------------------------------------------- validate

def test_validate_unknown_driver_names_it_and_the_choices():
    config = base_config()
    config.driver = "pmap"
    with pytest.raises(ConfigError, match=r"driver='pmap' is unknown; set --config\.driver to one of") as e:
        validate(config)
    for choice in DRIVERS:
        assert repr(choice) in str(e.value)


@pytest.mark.parametrize("key", ["global_batch_size", "eval_batch_size", "log_every"])
def test_validate_batch_sizes_and_log_every_must_be_positive(key):
    config = base_config()
    config[key] = 0
    with pytest.raises(ConfigError, match=rf"{key}=0 must be >= 1"):
        validate(config)


def test_validate_needs_steps_or_epochs():
    config = base_config()
    config.num_epochs = 0.0
    with pytest.raises(ConfigError, match=r"num_steps=0, num_epochs=0\.0: set num_steps > 0 or num_epochs > 0"):
        validate(config)
    config.num_steps = 10
    validate(config)  # num_steps alone is enough
    config.num_steps = -1
    with pytest.raises(ConfigError, match=r"num_steps=-1"):
        validate(config)


def test_validate_eval_every_and_emulation_non_negative():
    config = base_config()
    config.eval_every = -1
    with pytest.raises(ConfigError, match=r"eval_every=-1 must be >= 0"):
        validate(config)
    config = base_config()
    config.emulate_cpu_devices = -1
    with pytest.raises(ConfigError, match=r"emulate_cpu_devices=-1 must be >= 0"):
        validate(config)


@pytest.mark.parametrize("mesh", [("data", 8), ((8, "data"),), (("data",),), (("data", 4, "model"),)])
def test_validate_mesh_must_be_name_size_pairs(mesh):
    config = base_config()
    config.mesh = mesh
    with pytest.raises(ConfigError, match=r"mesh=.* must be \(name, size\) pairs, e\.g\. \(\('data', -1\),\)"):
        validate(config)


def test_validate_mesh_sizes_must_be_integers():
    # Otherwise it surfaces much later as "invalid literal for int()" inside make_mesh.
    config = base_config()
    config.mesh = (("data", "four"),)
    with pytest.raises(ConfigError, match=r"mesh="):
        validate(config)


def test_validate_model_needs_a_name():
    config = base_config()
    with config.unlocked():
        del config.model["name"]
    with pytest.raises(ConfigError, match=r"config\.model needs a 'name'"):
        validate(config)


# ------------------------------------------------------------------- override

def test_override_returns_a_new_config_and_leaves_the_original():
    config = load(DIGITS)
    before = copy.deepcopy(config.to_dict())
    new = override(config, **{"model.features": (32,)}, num_steps=5)
    assert new is not config
    assert new.model.features == (32,) and new.num_steps == 5
    assert config.to_dict() == before
    assert new.is_locked
    with pytest.raises(AttributeError):
        new.new_key = 1
    assert dtx.override is override


def test_override_coerces_int_to_float():
    new = override(base_config(), **{"optimizer.learning_rate": 1})
    assert new.optimizer.learning_rate == 1.0 and type(new.optimizer.learning_rate) is float


@pytest.mark.parametrize(
    "key, hint",
    [("model.featurs", "features"), ("optimiser.name", "optimizer"), ("num_step", "num_steps")],
)
def test_override_unknown_key_suggests_the_right_one(key, hint):
    config = base_config()
    with pytest.raises(ConfigError, match=rf"unknown config key {key!r} \(did you mean {hint!r}\?\)"):
        override(config, **{key: 1})


def test_override_unknown_key_without_a_close_match():
    with pytest.raises(ConfigError, match=r"unknown config key 'xyzzy'"):
        override(base_config(), xyzzy=1)


def test_override_key_below_a_leaf_is_a_config_error():
    # "model.name" is a string; there is nothing below it to set.
    with pytest.raises(ConfigError, match=r"model\.name\.x"):
        override(base_config(), **{"model.name.x": 1})


def test_override_wrong_type_names_the_key():
    with pytest.raises(ConfigError, match=r"config key 'num_steps'.*ten"):
        override(base_config(), num_steps="ten")
    with pytest.raises(ConfigError, match=r"config key 'num_steps'.*1\.5"):
        override(base_config(), num_steps=1.5)


def test_override_validates_the_result():
    with pytest.raises(ConfigError, match=r"driver='pmap' is unknown"):
        override(base_config(), driver="pmap")
    with pytest.raises(ConfigError, match=r"mesh=.*must be \(name, size\) pairs"):
        override(base_config(), mesh=((4, "data"),))


def test_every_experiment_file_loads():
    """Experiment files are public interface: each must load, locked and valid, as shipped."""
    import glob

    experiments = sorted(glob.glob(os.path.join(REPO, "experiments", "*.py")))
    names = [os.path.basename(p) for p in experiments if not p.endswith("__init__.py")]
    assert {"digits_mlp.py", "digits_lenet.py", "large_batch.py"} <= set(names)
    for name in names:
        config = load(os.path.join(REPO, "experiments", name))
        assert config.is_locked


def test_dgc_momentum_refuses_a_momentum_optimizer():
    base = base_config()
    with pytest.raises(ConfigError, match="momentum twice.*optimizer.name=sgd"):
        override(base, **{"compression.name": "topk", "compression.momentum": 0.9})
    ok = override(base, **{"compression.name": "topk", "compression.momentum": 0.9, "optimizer.name": "sgd"})
    assert ok.optimizer.name == "sgd"


@pytest.mark.parametrize("key, value", [("profile_steps", -1), ("peak_flops", -1.0)])
def test_observability_keys_must_not_be_negative(key, value):
    with pytest.raises(ConfigError, match=f"{key}={value} must be >= 0"):
        override(base_config(), **{key: value})


# ---------------------------------------------------------------- bad input found by a probe (66 inputs)

@pytest.mark.parametrize("override, message", [
    ("--config.optimizer.learning_rate=nan", r"optimizer\.learning_rate=nan is not a finite number"),
    ("--config.optimizer.learning_rate=-0.1", r"optimizer\.learning_rate=-0\.1 must be >= 0"),
    ("--config.watchdog_seconds=-1", r"watchdog_seconds=-1\.0 must be >= 0"),
    ("--config.model.features=(256, -4)", r"model\.features=\(256, -4\): widths and sizes must be >= 1"),
    ("--config.optimizer.momentum=1.5", r"optimizer\.momentum=1\.5 must be in \[0, 1\)"),
    ("--config.loss_scale.backoff=inf", r"loss_scale\.backoff=inf is not a finite number"),
])
def test_non_finite_negative_and_out_of_range_numbers_are_refused(override, message):
    with pytest.raises(ConfigError, match=message):
        load(DIGITS, [override])


def test_a_broken_experiment_file_is_named_with_the_fix(tmp_path):
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(:\n    pass\n")
    with pytest.raises(ConfigError, match=r"broken\.py, line 1: invalid syntax .*not valid Python"):
        load(str(broken))
    empty = tmp_path / "empty.py"
    empty.write_text("CONFIG = 1\n")
    with pytest.raises(ConfigError, match=r"empty\.py defines no get_config\(\)"):
        load(str(empty))


def test_an_experiment_file_is_decoded_as_python_decodes_it(tmp_path):
    """The probe: a latin-1 file that declares its coding (PEP 263), which Python compiles, and random bytes
    both ended in a UnicodeDecodeError traceback (the file was read as UTF-8 whatever it declared)."""
    latin = tmp_path / "latin.py"
    latin.write_bytes("# -*- coding: latin-1 -*-\n# r\xe9sum\xe9: this comment is latin-1\n"
                      "from dtx.config import base_config\n\n\ndef get_config():\n    config = base_config()\n"
                      "    config.wandb.name = 'caf\xe9'\n    return config\n".encode("latin-1"))
    assert load(str(latin)).wandb.name == "caf\u00e9"
    noise = tmp_path / "noise.py"
    noise.write_bytes(b"def get_config():\n    pass\n# \xff\xfe\x9c\n")
    with pytest.raises(ConfigError, match=r"noise\.py, line 3: byte 0xff is not valid utf-8 .*save it as UTF-8, or "
                                          r"declare its encoding"):
        load(str(noise))
    unknown = tmp_path / "unknown.py"
    unknown.write_bytes(b"# -*- coding: klingon -*-\ndef get_config():\n    pass\n")
    with pytest.raises(ConfigError, match=r"unknown\.py: unknown encoding: klingon \(its coding declaration\)"):
        load(str(unknown))


# ---------------------------------------------------------------- plug-in blocks: each setting belongs to a choice

def test_check_block_refuses_a_changed_key_the_choice_does_not_take():
    """The one helper every plug-in family's check calls: a key away from base_config()'s default that the
    chosen plug-in does not take is refused, naming the key, the choice, what it takes and who takes the key."""
    from dtx.config import check_block, chosen_settings

    taken = {"sync": (), "ssp": ("staleness",), "async": ("staleness", "random_delay")}
    config = override(base_config(), **{"strategy.name": "ssp", "strategy.staleness": 3})
    check_block(config, "strategy", taken)  # ssp takes staleness; every other key is at its default
    assert chosen_settings(config.strategy, taken) == {"staleness": 3}
    config.unlock().strategy.random_delay = True
    with pytest.raises(ConfigError, match=r"^strategy.random_delay=True applies to strategy.name=async only, not ssp "
                                          r"\(strategy 'ssp' takes: staleness\); leave strategy.random_delay at its "
                                          r"default False or choose a strategy.name that takes it$"):
        check_block(config, "strategy", taken)
    config.strategy.name = "sync"
    with pytest.raises(ConfigError, match=r"strategy.random_delay=True .*; strategy.staleness=3 applies to "
                                          r"strategy.name=ssp or async only, not sync \(strategy 'sync' takes none\)"):
        check_block(config, "strategy", taken)
    config.strategy.name = "unheard_of"  # an unknown name is its family's own error
    check_block(config, "strategy", taken)
    assert chosen_settings(config.strategy, taken) == {}


def test_a_list_read_back_from_json_equals_its_tuple_default():
    from dtx.config import check_block

    config = base_config().unlock()
    config.strategy.mixing = list(config.strategy.mixing)
    check_block(config, "strategy", {"sync": ()})


def test_a_factory_declares_its_settings_by_its_signature():
    from dtx.config import declared_settings

    def backupish(backup_workers: int = 0, stragglers=None):
        return backup_workers, stragglers

    assert declared_settings(backupish) == ("backup_workers", "stragglers")
    assert declared_settings(backupish, supplied=("stragglers",)) == ("backup_workers",)
    with pytest.raises(TypeError, match=r"takes \*_: a plug-in's factory names each setting it takes"):
        declared_settings(lambda period=1, **_: None)


def test_a_plugin_that_replaces_the_optimizers_part_needs_plain_sgd():
    """replaces_optimizer is declared on the factory; check_plain_sgd reads the declaration, not a name."""
    from dtx.config import check_plain_sgd, replaces_optimizer

    @replaces_optimizer("momentum", when="momentum")
    def dgc_like(momentum: float = 0.0):
        return momentum

    base = base_config()
    check_plain_sgd(base, "compression", dgc_like)  # momentum 0: no momentum of its own
    check_plain_sgd(base, "compression", None)  # an unknown name
    with_momentum = base.copy_and_resolve_references()
    with_momentum.compression.momentum = 0.9
    with pytest.raises(ConfigError, match=r"compression.momentum=0.9 \(compression 'none'\) does the optimizer's "
                                          r"momentum itself, so optimizer.name='adam' would apply momentum twice; "
                                          r"set --config.optimizer.name=sgd .* or compression.momentum=0"):
        check_plain_sgd(with_momentum, "compression", dgc_like)
    with_momentum.optimizer.name = "sgd"
    check_plain_sgd(with_momentum, "compression", dgc_like)


def test_every_packaged_experiment_sets_only_what_its_choices_take():
    """The experiments with an argument too (sweeps set each variant's own settings)."""
    from dtx.experiments import compression_sweep, sync_strategies

    arguments = {"compression_sweep": list(compression_sweep.VARIANTS), "sync_strategies": list(sync_strategies.SETTINGS),
                 "large_batch": ["momentum", "lars", "lamb"]}
    for name, variants in arguments.items():
        for variant in variants:
            assert load(f"{name}:{variant}").is_locked
