"""Every test runs on exactly 8 emulated CPU devices (DESIGN.md §4.11).

The device count is fixed here, before JAX starts; a session fixture checks it
and *fails* (never skips) when it is wrong, e.g. because a plugin started JAX first.
"""

import os
import resource
import time

# A collective that hangs (DESIGN.md §2) should fail in seconds, not minutes.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [
        os.environ.get("XLA_FLAGS", ""),
        "--xla_cpu_collective_call_warn_stuck_timeout_seconds=5",
        "--xla_cpu_collective_call_terminate_timeout_seconds=20",
    ])
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import pytest  # noqa: E402

NUM_DEVICES = 8
jax.config.update("jax_num_cpu_devices", NUM_DEVICES)

# The suite's processes (and the runs and commands they start) share one persistent compilation cache,
# as every dtx run does (dtx.xla_cache): a program one test file compiled, another file's process reads
# back. $DTX_COMPILATION_CACHE names the folder (default: the user's cache folder).
from dtx import xla_cache  # noqa: E402

xla_cache.enable("auto")
_COMPILING = xla_cache.CompileClock().__enter__()  # this process's compiles, for DTX_TEST_COMPILE_STATS


_BY_FILE: dict = {}
_BY_TEST: dict = {}  # test id -> CPU seconds (its fixtures' set-up included), for the stats
_BY_NAME: dict = {}  # compiled function name -> [seconds, programs] (XLA compile or cache read), for the stats


def _by_name(event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        entry = _BY_NAME.setdefault(kwargs.get("fun_name", "?"), [0.0, 0])
        entry[0] += seconds
        entry[1] += 1


if os.environ.get("DTX_TEST_COMPILE_STATS"):
    jax.monitoring.register_event_duration_secs_listener(_by_name)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Each test file's share of this process's compiles (its tests' set-up included), for the stats."""
    before = (_COMPILING.backend_s, _COMPILING.programs, _COMPILING.hits, time.perf_counter(), _cpu_seconds())
    yield
    seconds, programs, hits, wall, cpu = _BY_FILE.get(item.fspath.basename, (0.0, 0, 0, 0.0, 0.0))
    _BY_TEST[item.nodeid] = _cpu_seconds() - before[4]  # set-up of the module's fixtures included
    _BY_FILE[item.fspath.basename] = (seconds + _COMPILING.backend_s - before[0],
                                      programs + _COMPILING.programs - before[1], hits + _COMPILING.hits - before[2],
                                      wall + time.perf_counter() - before[3], cpu + _cpu_seconds() - before[4])


def _cpu_seconds() -> float:
    """CPU seconds of this process (all its threads) and of the children it waited for: a file whose wall time
    is much more than this waits (on a timeout, a subprocess's start) and leaves its core to another worker."""
    return sum(r.ru_utime + r.ru_stime for r in map(resource.getrusage, (resource.RUSAGE_SELF,
                                                                          resource.RUSAGE_CHILDREN)))


def pytest_sessionfinish(session, exitstatus):
    """With $DTX_TEST_COMPILE_STATS=FILE, each test process appends what it compiled and read back (JAX's
    own timings) to FILE: how the suite's time splits, and what the shared cache saved."""
    path = os.environ.get("DTX_TEST_COMPILE_STATS")
    if path:
        import json

        with open(path, "a") as f:
            f.write(json.dumps({"worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
                                **_COMPILING.record(), "compile_only_s": round(_COMPILING.compile_s, 3),
                                # compile s, programs, hits, wall s, cpu s
                                "files": {name: [round(t, 1), n, h, round(w, 1), round(c, 1)]
                                          for name, (t, n, h, w, c) in _BY_FILE.items()},
                                "names": {name: [round(t, 2), n] for name, (t, n) in  # compile s, programs
                                          sorted(_BY_NAME.items(), key=lambda kv: -kv[1][0])},
                                "tests": {name: round(c, 1) for name, c in  # the 80 costliest tests' CPU s
                                          sorted(_BY_TEST.items(), key=lambda kv: -kv[1])[:80]}}) + "\n")


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    devices = jax.devices()
    assert len(devices) == NUM_DEVICES, (
        f"tests need exactly {NUM_DEVICES} CPU devices, found {len(devices)}: {devices}. "
        "JAX was started before tests/conftest.py could configure it."
    )
    return devices


@pytest.fixture(scope="session")
def digits():
    """The digits dataset (read-only arrays), loaded once per test process."""
    from dtx.data import datasets

    return datasets.load_dataset("digits")


@pytest.fixture(scope="session")
def mesh():
    """All 8 devices on one data axis."""
    from dtx import mesh as mesh_lib

    return mesh_lib.make_mesh([("data", -1)])


@pytest.fixture(scope="session")
def mlp16(digits, mesh):
    """The strategy tests' common set-up: digits, a flat mesh of the 8 devices, ``mlp(16)``, its example
    shape and a jitted one-device gradient (references); ``mlp16(batch, steps)`` adds that many batches."""
    from dtx import models
    from dtx.data import TrainLoader
    from dtx.data.tasks import cross_entropy

    model = models.build_model("mlp", features=(16,))
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    grad = jax.jit(jax.grad(lambda p, x, y: cross_entropy(model.apply({"params": p}, x, train=True), y).mean()))

    def make(batch: int, steps: int) -> dict:
        loader = TrainLoader(digits.train, batch, mesh, seed=0)
        return dict(digits=digits, mesh=mesh, model=model, example=example, grad=grad,
                    batches=[loader.batch(s) for s in range(steps)])

    return make


@pytest.fixture(scope="session")
def run_steps():
    """``run_steps(setup, tx, steps, strategy=None)``: train ``steps`` steps of an ``mlp16`` set-up, keeping
    every step's host state and metrics (``states``, ``records``), the step function and the last state."""
    from dtx.step.state import init_train_state
    from dtx.step import StepSpec, make_train_step

    def run(setup, tx, steps, strategy=None):
        state = init_train_state(setup["model"], tx, setup["example"], seed=0, mesh=setup["mesh"],
                                 per_worker=StepSpec(strategy=strategy))
        step = make_train_step(setup["model"], tx, setup["mesh"], StepSpec(strategy=strategy, donate=False))
        states, records = [], []
        for t in range(steps):
            state, metrics = step(state, setup["batches"][t])
            records.append(jax.device_get(metrics))  # also waits for the step: no steps pile up in flight
            states.append(jax.device_get(state))
        return dict(states=states, records=records, step=step, state=state)

    return run


# The longest test files start first: the suite runs file by file on one process per core
# (--dist=loadfile), so a long file handed out last would keep one core busy while the others idle.
# Each file's wall seconds on 2 cores, from $DTX_TEST_COMPILE_STATS (2026-12-01: launch 207, docs 141,
# strategies 120, collectives 94 ... integrity 37); any file not listed keeps its place after these.
_LONGEST_FIRST = ("test_launch.py", "test_docs.py", "test_strategies.py", "test_collectives.py", "test_compress.py",
                  "test_comm_accounting.py", "test_parallel.py", "test_checkpoint.py", "test_precision.py",
                  "test_memory.py", "test_tasks.py", "test_activations.py", "test_pipeline_parallel.py",
                  "test_accumulate.py", "test_trainer.py", "test_step.py", "test_notebook.py", "test_models_zoo.py",
                  "test_integrity.py")


def pytest_xdist_auto_num_workers(config):
    """One worker per core, and one more: several files spend much of their wall time waiting (a launched job's
    processes starting, a watchdog's or a stall bound's seconds running out, a subprocess's JAX import), and
    the spare worker compiles while they wait. $PYTEST_XDIST_AUTO_NUM_WORKERS still decides when set."""
    if os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS"):
        return int(os.environ["PYTEST_XDIST_AUTO_NUM_WORKERS"])
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1) + 1


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(_LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(os.path.basename(str(item.fspath)), len(rank)))  # stable: order kept within
