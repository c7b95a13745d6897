"""LeNet with batch normalisation on digits: synchronised batch norm under both drivers.

Launch:

    dtx train experiments/digits_lenet.py
    dtx train experiments/digits_lenet.py --config.driver=jit

Expected: test_accuracy >= 0.97. With the shard_map driver each device normalises with the
statistics of the *global* batch (LeNet's ``norm_axis_name`` is set to the batch axes), so both
drivers compute what one device would.
"""

from ml_collections import ConfigDict

from dtx.config import base_config


def get_config():
    config = base_config()
    config.model = ConfigDict(dict(name="lenet", conv_features=(6, 16), dense_features=(120, 84), use_batch_norm=True))
    config.optimizer.name = "momentum"
    config.optimizer.learning_rate = 0.05
    config.global_batch_size = 128
    config.num_epochs = 15.0
    return config
