"""dtx: distributed deep-learning training on JAX meshes.

Implements, side by side, the techniques of *A Hitchhiker's Guide On Distributed
Training of Deep Neural Networks* (Chahal et al., arXiv 1810.11787) and
*Distributed Deep Learning Using Synchronous SGD* (Das et al., arXiv 1602.06709).

Quick start (a notebook's first cell, before any JAX computation)::

    import dtx
    dtx.emulate_cpu_devices(8)
    from experiments import digits_mlp
    result = dtx.train(digits_mlp.get_config(), workdir="runs/quickstart")
"""

from dtx.config import ConfigError, base_config, load, override
from dtx.mesh import MeshError, emulate_cpu_devices, make_mesh
from dtx.state import TrainState, init_train_state
from dtx.step import make_eval_step, make_train_step


def train(config, workdir):
    """Run an experiment config; see :func:`dtx.train.train`."""
    from dtx.train import train as _train  # imported lazily: pulls in datasets, metrics writers

    return _train(config, workdir)


__all__ = [
    "ConfigError", "MeshError", "TrainState", "base_config", "emulate_cpu_devices", "init_train_state",
    "load", "make_eval_step", "make_mesh", "make_train_step", "override", "train",
]
__version__ = "0.1.0"
