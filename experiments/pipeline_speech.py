"""Das et al.'s fully connected speech DNN cut into pipeline stages: GPipe, 1F1B and interleaved side by side.

The speech DNN (Das et al., arXiv 1602.06709, §5; models/speech_dnn.py) is all fully connected layers,
the kind of model whose weights outgrow one device. Here it is 7 layers of 256 (6 hidden + the classifier)
trained on the digits with Adam 2e-3, global batch 128, 8 micro-batches per step, for 10 epochs, its layers
cut into stages on a ``stage`` mesh axis (the other axis splits the batch) by the schedule the argument
names:

===========  ===========================================================================================
gpipe        4 stages x 2 data shards, every micro-batch forward then every one backward (Huang et al.
             2019); bubble 3/11 of the step, each stage keeps 8 micro-batches' inputs
1f1b         the same stages, each micro-batch backward as soon as it can (PipeDream-Flush, Narayanan et
             al. 2021): the same bubble, at most 7 inputs kept on the first stage and 1 on the last
interleaved  2 devices x 2 chunks of layers each x 4 data shards (Narayanan et al. 2021, §2.2.2):
             bubble 1/17
===========  ===========================================================================================

The stages are balanced by their FLOPs (``pipeline.boundaries`` sets them by hand). Launch one:

    dtx train experiments/pipeline_speech.py:1f1b

Expected (one seed, 360 test digits): test_accuracy 0.9917 for all three — they compute the same
gradients as one device (docs/pipeline.md).
"""

from dtx.config import base_config
from ml_collections import ConfigDict

LAYOUTS = {
    "gpipe": dict(mesh=(("stage", 4), ("data", 2)), virtual_stages=1),
    "1f1b": dict(mesh=(("stage", 4), ("data", 2)), virtual_stages=1),
    "interleaved": dict(mesh=(("stage", 2), ("data", 4)), virtual_stages=2),
}


def get_config(schedule: str = "1f1b"):
    if schedule not in LAYOUTS:
        raise ValueError(f"pipeline_speech: schedule {schedule!r} must be one of {sorted(LAYOUTS)}")
    config = base_config()
    config.dataset.name = "digits"
    config.model = ConfigDict(dict(name="speech_dnn", hidden=(256,) * 6))
    config.optimizer.name = "adam"
    config.optimizer.learning_rate = 2e-3
    config.global_batch_size = 128
    config.num_epochs = 10.0
    config.log_every = 20
    config.mesh = LAYOUTS[schedule]["mesh"]
    config.parallel.name = "pipeline"
    config.pipeline.microbatches = 8  # the micro-batches are the step's gradient accumulation
    config.pipeline.schedule = schedule
    config.pipeline.virtual_stages = LAYOUTS[schedule]["virtual_stages"]
    return config
