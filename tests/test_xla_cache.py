"""dtx.xla_cache: the persistent compilation cache is on by default, a program read back is the program
that was compiled (its values and its analyses), a second launch compiles nothing, and "" turns it off."""

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx import config as config_lib
from dtx import mesh as mesh_lib
from dtx import xla_cache
from dtx.comm import hlo
from dtx.run.trainer import train

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT = os.path.join(REPO, "experiments", "digits_mlp.py")
TINY = ("--config.num_steps=4", "--config.model.features=(16,)", "--config.log_every=2", "--config.progress=False")


@pytest.fixture
def restore_cache():
    """Tests here point the cache elsewhere; the suite's shared folder comes back afterwards."""
    yield
    xla_cache.enable("auto")


def test_auto_is_the_users_cache_folder_and_the_environment_can_move_or_stop_it(monkeypatch, tmp_path):
    monkeypatch.delenv(xla_cache.ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert xla_cache.resolve("auto") == str(tmp_path / "xdg" / "dtx" / "jax")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert xla_cache.resolve("auto") == str(tmp_path / "home" / ".cache" / "dtx" / "jax")
    monkeypatch.setenv(xla_cache.ENV, str(tmp_path / "shared"))
    assert xla_cache.resolve("auto") == str(tmp_path / "shared")
    monkeypatch.setenv(xla_cache.ENV, "")
    assert xla_cache.resolve("auto") == ""  # set empty: off for the commands that take no config
    assert xla_cache.resolve("") == ""
    assert xla_cache.resolve(str(tmp_path / "mine")) == str(tmp_path / "mine")


def test_off_leaves_jax_without_a_folder_and_a_bad_folder_is_refused(tmp_path, restore_cache):
    assert xla_cache.enable("") == ""
    assert jax.config.jax_compilation_cache_dir is None
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(xla_cache.CacheError, match=r"compilation_cache=.*cannot create.*--config.compilation_cache="):
        xla_cache.enable(str(blocker / "cache"))
    with pytest.raises(xla_cache.CacheError, match="must be a string"):
        xla_cache.resolve(None)


def _program(mesh):
    """A fresh jitted function each call (so JAX's in-memory caches cannot answer): a sharded matmul
    whose gradient all-reduces over the mesh."""
    def loss(w, x):
        return jnp.tanh(x @ w).sum()
    return jax.jit(jax.grad(loss), in_shardings=(mesh_lib.replicated(mesh), mesh_lib.batch_sharding(mesh)))


def test_clocks_nest_and_each_stops_when_it_closes():
    """Two clocks holding equal figures are still two: closing the inner one leaves the outer one running."""
    with xla_cache.CompileClock() as outer:
        with xla_cache.CompileClock() as inner:
            pass
        assert inner == inner and inner != outer  # equal figures (nothing compiled), different clocks
        jax.jit(lambda x: x * 7 - 1).lower(np.ones(3, np.float32)).compile()
    assert (outer.programs, inner.programs) == (1, 0)


def test_a_program_read_back_is_the_compiled_program(tmp_path, restore_cache):
    assert xla_cache.enable(str(tmp_path / "cache")) == str(tmp_path / "cache")
    mesh = mesh_lib.make_mesh([("data", -1)])
    w, x = np.linspace(-1, 1, 24 * 8, dtype=np.float32).reshape(24, 8), np.ones((16, 24), np.float32)
    programs = []
    for _ in range(2):
        with xla_cache.CompileClock() as clock:
            compiled = _program(mesh).lower(w, x).compile()
        programs.append((clock, compiled))
    (cold, first), (warm, again) = programs
    assert (cold.programs, cold.hits, cold.compiles) == (1, 0, 1)
    assert (warm.programs, warm.hits, warm.compiles) == (1, 1, 0)
    assert warm.cache_read_s > 0 and cold.trace_s > 0 and warm.trace_s > 0  # tracing is not saved
    assert os.listdir(tmp_path / "cache")
    # What --verify and the accountant read: the same text, FLOPs, bytes and memory.
    # (The text differs only in source-location metadata, which JAX leaves out of the cache key.)
    assert _no_metadata(again.as_text()) == _no_metadata(first.as_text())
    assert hlo.communication(again) == hlo.communication(first) and hlo.total(first).bytes_sent > 0
    assert again.cost_analysis() == first.cost_analysis()
    assert again.memory_analysis().temp_size_in_bytes == first.memory_analysis().temp_size_in_bytes
    np.testing.assert_array_equal(np.asarray(again(w, x)), np.asarray(first(w, x)))


def _no_metadata(text):
    """The program without its source locations (the metadata and the module's frame table)."""
    return [re.sub(r", metadata=\{[^}]*\}", "", line) for line in text.splitlines() if "file_name_id=" not in line]


def test_the_folder_can_change_or_go_after_jax_opened_it(tmp_path, restore_cache):
    mesh = mesh_lib.make_mesh([("data", -1)])
    w, x = np.ones((24, 8), np.float32), np.ones((16, 24), np.float32)

    def compile_in(setting):
        xla_cache.enable(setting)
        with xla_cache.CompileClock() as clock:
            _program(mesh).lower(w, x).compile()
        return clock.hits

    first, second = tmp_path / "first", tmp_path / "second"
    assert compile_in(str(first)) == 0 and len(os.listdir(first)) == 1
    assert compile_in(str(second)) == 0 and len(os.listdir(second)) == 1  # JAX had opened `first`
    assert compile_in(str(first)) == 1
    assert compile_in("") == 0 and len(os.listdir(first)) == len(os.listdir(second)) == 1


def _first_record(workdir):
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return json.loads(f.readline())


def test_a_second_launch_compiles_nothing_and_trains_the_same_run(tmp_path, restore_cache):
    cache = tmp_path / "cache"
    runs = {}
    for name, setting in (("cold", cache), ("warm", cache), ("off", "")):
        config = config_lib.load(DEFAULT, TINY + (f"--config.compilation_cache={setting}",))
        runs[name] = (train(config, tmp_path / name), _first_record(tmp_path / name))
    cold, warm, off = (record for _, record in runs.values())
    assert cold["startup_compiles"] >= 3 and cold["startup_cache_hits"] == 0  # init, the step, its quiet twin ...
    assert warm["startup_compiles"] == 0 and warm["startup_cache_hits"] == cold["startup_compiles"]
    assert off["startup_cache_hits"] == 0 and off["startup_compiles"] == cold["startup_compiles"]
    assert cold["startup_compile_s"] > 0 and warm["startup_trace_s"] > 0
    # The programs read back train the same run, bit for bit, and "" wrote nothing into the folder.
    params = [jax.tree.leaves(result.state.params) for result, _ in runs.values()]
    for leaves in params[1:]:
        for a, b in zip(params[0], leaves, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert runs["cold"][0].metrics == runs["warm"][0].metrics == runs["off"][0].metrics


def test_a_run_refuses_an_unusable_cache_folder_before_it_compiles(tmp_path, restore_cache):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    config = config_lib.load(DEFAULT, TINY + (f"--config.compilation_cache={blocker}/cache",))
    with pytest.raises(xla_cache.CacheError, match="compilation_cache="):
        train(config, tmp_path / "run")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
