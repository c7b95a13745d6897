"""Every test runs on exactly 8 emulated CPU devices (DESIGN.md §4.11).

The device count is fixed here, before JAX starts; a session fixture checks it
and *fails* (never skips) when it is wrong, e.g. because a plugin started JAX first.
"""

import os

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


@pytest.fixture(scope="session", autouse=True)
def eight_devices():
    devices = jax.devices()
    assert len(devices) == NUM_DEVICES, (
        f"tests need exactly {NUM_DEVICES} CPU devices, found {len(devices)}: {devices}. "
        "JAX was started before tests/conftest.py could configure it."
    )
    return devices
