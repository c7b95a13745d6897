"""Large-batch training: SGD-momentum vs LARS vs LAMB with the linear scaling rule and warmup.

The Hitchhiker's Guide §4.1 (large batches): scale the learning rate with the batch
(Goyal et al. 2017), warm it up, and use layer-wise trust ratios (LARS, You et al.
2017; LAMB, You et al. 2019) to keep accuracy as the batch grows. The task is the
deterministic synthetic classification set (16,384 training / 4,096 held-out
examples, 32 features, 10 classes of 4 clusters each), large enough for a 16x sweep.

Launch one point (optimizer as the config argument; batch by override):

    dtx train experiments/large_batch.py:lars --config.global_batch_size=2048

The whole sweep, table and plot: ``python benchmarks/large_batch_sweep.py`` (BENCHMARKS.md).
Expected: at the base batch (128) all three reach about the same test accuracy;
results at 16x are in BENCHMARKS.md.
"""

from dtx.config import base_config

# Base learning rates at the base batch of 128, scaled linearly with the global batch.
BASE_LR = {"momentum": 0.05, "lars": 0.5, "lamb": 2e-3}


def get_config(optimizer: str = "momentum"):
    if optimizer not in BASE_LR:
        raise ValueError(f"large_batch: optimizer {optimizer!r} must be one of {sorted(BASE_LR)}")
    config = base_config()
    config.dataset.name = "synthetic"
    config.dataset.synthetic.num_train = 16384
    config.dataset.synthetic.num_test = 4096
    config.model.features = (256, 256)
    config.optimizer.name = optimizer
    config.optimizer.learning_rate = BASE_LR[optimizer]
    config.optimizer.scaling = "linear"
    config.optimizer.base_batch_size = 128
    config.optimizer.weight_decay = 1e-4
    config.optimizer.schedule = "polynomial"
    config.optimizer.warmup_epochs = 2.0
    config.global_batch_size = 128
    config.eval_batch_size = 1024
    config.num_epochs = 20.0
    config.log_every = 50
    return config
