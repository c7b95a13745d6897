"""ResNet-18 on CIFAR-10, read through grain with the standard augmentation, synchronous data parallel.

The data: CIFAR-10's binary version, from https://www.cs.toronto.edu/~kriz/cifar-10-binary.tar.gz
(162 MB), extracted into ``~/data/cifar10`` (or any folder named by ``--config.dataset.data_dir``)::

    mkdir -p ~/data/cifar10 && tar xzf cifar-10-binary.tar.gz -C ~/data/cifar10

This creates ``~/data/cifar10/cifar-10-batches-bin/``. Without the files, the run stops before
anything compiles, with a message that says what to download from where and where to put it. The
batch files are memory-mapped and read a batch at a time (``dtx.data.images.CifarBinary``).
``cifar10.npz`` (uint8 NHWC) or an image folder (``--config.dataset.name=image_folder``:
``train/<class>/*.png``, ``test/<class>/...``) serve too.

Launch:

    dtx train experiments/cifar10_resnet18.py
    dtx train experiments/cifar10_resnet18.py --config.dataset.data_dir=/data/cifar10 --config.dataset.workers=4

The recipe is that of He et al. 2016, §4.2: 4-pixel padding and a random 32×32 crop, horizontal flips,
per-channel normalisation with the training set's mean and standard deviation. The network is
``models/resnet.py``'s ResNet-18 as published for ImageNet (7×7/2 stem and a 3×3/2 max pool, so a
32×32 image is 8×8 when the first stage sees it). The optimizer is Nesterov SGD at
0.1 × batch / 256 (Goyal et al. 2017) with weight decay 5e-4, 2 warmup epochs and then cosine
decay, on a global batch of 512 for 30 epochs (2,910 steps), with ``dataset.workers=2`` prefetching
processes.

Expected result: **not measured**. CIFAR-10 cannot be downloaded on the machine dtx is developed on
(it reaches only the Python package index), and 30 epochs of ResNet-18 on its two CPU cores would
take hours. What is tested (``tests/test_images.py``) is that this config trains on a small
generated set of CIFAR binary files and fails with the download message without them. The input
pipeline's rate against this model's step rate is in BENCHMARKS.md ("Input pipeline").
"""

from ml_collections import ConfigDict

from dtx.config import base_config

# Per-channel mean and standard deviation of CIFAR-10's 50,000 training images, pixels in [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)


def get_config():
    config = base_config()
    config.dataset.name = "cifar10"
    config.dataset.data_dir = "~/data/cifar10"
    config.dataset.augment = ConfigDict(dict(crop_padding=4, flip=True, normalize=True, mean=CIFAR10_MEAN,
                                             std=CIFAR10_STD))
    config.dataset.workers = 2
    config.model = ConfigDict(dict(name="resnet18", stage_sizes=(2, 2, 2, 2), width=64))
    config.optimizer.name = "nesterov"
    config.optimizer.learning_rate = 0.1
    config.optimizer.scaling = "linear"
    config.optimizer.base_batch_size = 256
    config.optimizer.weight_decay = 5e-4
    config.optimizer.schedule = "cosine"
    config.optimizer.warmup_epochs = 2.0
    config.global_batch_size = 512
    config.eval_batch_size = 1000
    config.num_epochs = 30.0
    config.eval_every = 485  # about every 5 epochs (97 steps each)
    return config
