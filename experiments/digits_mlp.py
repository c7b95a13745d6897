"""Default experiment: an MLP on scikit-learn's digits, synchronous data parallel on 8 devices.

Launch (emulates 8 CPU devices; uses the accelerators instead where there are any):

    dtx train experiments/digits_mlp.py
    dtx train experiments/digits_mlp.py --config.driver=jit

Expected: test_accuracy >= 0.97 (360 held-out digits), in about 10 s of wall time
on a 2-core machine, start-up and compilation included.
"""

from dtx.config import base_config


def get_config():
    config = base_config()
    config.dataset.name = "digits"
    config.model.features = (256, 256)
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 2e-3
    config.global_batch_size = 128
    config.num_epochs = 20.0
    return config
