"""dtx: distributed deep-learning training on JAX meshes.

Implements, side by side, the techniques of *A Hitchhiker's Guide On Distributed
Training of Deep Neural Networks* (Chahal et al., arXiv 1810.11787) and
*Distributed Deep Learning Using Synchronous SGD* (Das et al., arXiv 1602.06709).

Quick start (a notebook's first cell, before any JAX computation)::

    import dtx
    dtx.emulate_cpu_devices(8)
    from dtx.experiments import digits_mlp
    result = dtx.train(digits_mlp.get_config(), workdir="runs/quickstart")
"""

# Before anything slow: the dtx command catches SIGTERM from its first moment (dtx._sigterm; your program
# importing dtx installs nothing).
from dtx import _sigterm

_sigterm.install()

# Then: dtx.models and dtx.experiments resolve from a source checkout too (installed, setuptools maps them).
from dtx import _checkout

_checkout.install()

from dtx.compress import make_compressor  # noqa: E402
from dtx.config import ConfigError, base_config, load, override
from dtx.mesh import MeshError, emulate_cpu_devices, make_mesh
from dtx.step.pacing import paced
from dtx.precision import LossScaler, Policy, parse_policy
from dtx.step.state import TrainState, init_train_state
from dtx.step import StepSpec, make_eval_step, make_train_step
from dtx.strategies import make_strategy

# ``dtx.train`` is the function; the module that defines it is ``dtx.run.trainer``.
from dtx.run.trainer import TrainResult, train  # noqa: E402

__all__ = [
    "ConfigError", "LossScaler", "MeshError", "Policy", "StepSpec", "TrainResult", "TrainState", "base_config",
    "emulate_cpu_devices", "init_train_state", "load", "make_compressor", "make_eval_step", "make_mesh",
    "make_strategy", "make_train_step", "override", "paced", "parse_policy", "train",
]
__version__ = "0.1.0"
