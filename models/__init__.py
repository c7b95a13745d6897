"""Flax models, looked up by name from experiment configs.

A model is a ``flax.linen.Module`` called as ``model(inputs, train=bool)`` that
returns logits and takes ``dtype`` (compute) and ``param_dtype`` (stored weights)
attributes, so the precision policy can drive it. Models with batch statistics
declare a ``norm_axis_name`` attribute that the ``shard_map`` driver fills in.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn

from .lenet import LeNet
from .mlp import MLP
from .overfeat import OverFeatFast
from .resnet import ResNet18, ResNet50
from .speech_dnn import SpeechDNN
from .transformer import Transformer
from .vgg import VGGA

MODELS: dict[str, type[nn.Module]] = {
    "mlp": MLP,
    "lenet": LeNet,
    "vgg_a": VGGA,
    "overfeat_fast": OverFeatFast,
    "speech_dnn": SpeechDNN,
    "resnet18": ResNet18,
    "resnet50": ResNet50,
    "transformer": Transformer,
}

# Set by dtx from the dataset and the precision policy, never by the user's model block.
_RESERVED = ("num_classes", "dtype", "param_dtype", "norm_axis_name", "parent", "name")


class ModelConfigError(ValueError):
    """Unknown model name or keyword."""


def model_fields(name: str) -> dict[str, object]:
    """The user-settable keywords of model ``name`` with their defaults."""
    cls = _lookup(name)
    return {
        f.name: f.default
        for f in dataclasses.fields(cls)
        if f.init and f.name not in _RESERVED and f.default is not dataclasses.MISSING
    }


def build_model(name: str, **kwargs) -> nn.Module:
    """Instantiate model ``name``; unknown keywords raise naming the key and the valid ones."""
    cls = _lookup(name)
    allowed = set(model_fields(name)) | set(_RESERVED[:4])
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ModelConfigError(
            f"model {name!r} has no setting {unknown[0]!r} (config key model.{unknown[0]}); "
            f"valid settings: {', '.join(sorted(model_fields(name)))}"
        )
    return cls(**kwargs)


def _lookup(name: str) -> type[nn.Module]:
    if name not in MODELS:
        raise ModelConfigError(f"unknown model {name!r} (config key model.name); choose one of {sorted(MODELS)}")
    return MODELS[name]
