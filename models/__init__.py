"""Flax models, looked up by name from experiment configs.

A model is a ``flax.linen.Module`` called as ``model(inputs, train=bool)`` that
returns logits and takes ``dtype`` (compute) and ``param_dtype`` (stored weights)
attributes, so the precision policy can drive it. Models with batch statistics
declare a ``norm_axis_name`` attribute that the ``shard_map`` driver fills in.

``model.name`` may also name your own module class by import path, ``package.module:Class``
(:mod:`dtx.config.parts`): its dataclass fields with defaults are the block's settings, and dtx
fills ``num_classes``, ``dtype``, ``param_dtype`` and ``norm_axis_name`` where the class declares them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import flax.linen as nn
import numpy as np

from dtx import mesh as mesh_lib
from dtx.config import ConfigError, is_import_path, parameters, register_check, register_family, resolve

from .lenet import LeNet
from .mlp import MLP
from .moe import check_settings as check_moe
from .remat import check_policy
from .overfeat import OverFeatFast
from .resnet import ResNet18, ResNet50
from .speech_dnn import SpeechDNN
from .transformer import Transformer, check_modern, layout_refusal
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

# Set by dtx from the dataset, the precision policy, the driver and remat.policy, never by the user's model block
# (a model takes those it declares as fields).
_SUPPLIED = ("num_classes", "dtype", "param_dtype", "norm_axis_name", "remat")
_RESERVED = _SUPPLIED + ("parent", "name")


class ModelConfigError(ConfigError):
    """Unknown model name or keyword."""


def model_class(name: str) -> type[nn.Module]:
    """The class ``name`` chooses: a model of :data:`MODELS`, or your ``flax.linen.Module`` by import path
    (``package.module:Class``, :mod:`dtx.config.parts`)."""
    if not is_import_path(name):
        if name not in MODELS:
            raise ModelConfigError(f"unknown model {name!r} (config key model.name); choose one of {sorted(MODELS)}, "
                                   "or your own flax module as package.module:Class")
        return MODELS[name]
    try:
        cls = resolve(name, "model.name")
    except ConfigError as e:
        raise ModelConfigError(str(e)) from None
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise ModelConfigError(f"model.name={name!r} is {type(cls).__name__} {cls!r}, not a flax.linen.Module class; "
                               "name your model's class")
    return cls


def model_fields(name: str) -> dict[str, object]:
    """The user-settable keywords of model ``name`` with their defaults (for your class: its dataclass fields
    but those dtx sets, ``num_classes``, ``dtype``, ``param_dtype``, ``norm_axis_name``)."""
    cls = model_class(name)
    if is_import_path(name):
        try:
            return parameters(cls, f"model.name={name!r}", supplied=_RESERVED)
        except ConfigError as e:
            raise ModelConfigError(str(e)) from None
    return {
        f.name: _setting(f.default)
        for f in dataclasses.fields(cls)
        if f.init and f.name not in _RESERVED and f.default is not dataclasses.MISSING
    }


def _setting(default):
    """A field's default as a config value: a settings dataclass (the transformer's ``moe``) as a nested block."""
    return dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default


def _nested(cls: type, key: str, value):
    """A nested block's ``value`` (a mapping) as field ``key``'s settings dataclass, its unknown keys refused."""
    default = next((f.default for f in dataclasses.fields(cls) if f.name == key), None)
    if hasattr(value, "to_dict"):  # a ConfigDict (no Mapping)
        value = value.to_dict()
    if not (dataclasses.is_dataclass(default) and isinstance(value, Mapping)):
        return value
    names = [f.name for f in dataclasses.fields(default)]
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ModelConfigError(f"model.{key} has no setting {unknown[0]!r} (config key model.{key}.{unknown[0]}); "
                               f"valid settings: {', '.join(names)}")
    return dataclasses.replace(default, **value)


def build_model(name: str, **kwargs) -> nn.Module:
    """Instantiate model ``name``; unknown keywords raise naming the key and the valid ones.

    ``num_classes``, ``dtype``, ``param_dtype`` and ``norm_axis_name`` go to a class that declares them; your
    class without a ``dtype`` field computes as it is written, so a precision other than float32 is refused.
    """
    cls = model_class(name)
    settings = model_fields(name)
    unknown = sorted(set(kwargs) - set(settings) - set(_SUPPLIED))
    if unknown:
        raise ModelConfigError(_no_setting(name, unknown[0], settings))
    declared = {f.name for f in dataclasses.fields(cls) if f.init}
    if not is_import_path(name):
        kwargs = {key: _nested(cls, key, value) for key, value in kwargs.items()}
    for key in sorted(set(kwargs) & set(_SUPPLIED) - declared):
        value = kwargs.pop(key)
        if key == "remat" and value != "none":
            raise ModelConfigError(_no_remat(name, value))
        if key in ("dtype", "param_dtype") and value is not None and np.dtype(value) != np.float32:
            raise ModelConfigError(f"model {name!r} has no field {key!r}, so the precision policy's "
                                   f"{np.dtype(value).name} cannot reach its layers; give the class fields "
                                   "dtype and param_dtype (default jnp.float32) and pass them to its layers, or keep "
                                   "--config.precision at float32")
    return cls(**kwargs)


def takes_remat(name: str) -> bool:
    """Whether model ``name`` declares a ``remat`` field (it then applies ``remat.policy`` to its blocks)."""
    return any(f.name == "remat" and f.init for f in dataclasses.fields(model_class(name)))


def _no_remat(name: str, policy) -> str:
    return (f"remat.policy={policy!r}: model {name!r} does not take a rematerialisation policy (it declares no "
            "'remat' field; the transformer does); use --config.remat.policy=none with it")


def _no_setting(name: str, key: str, settings) -> str:
    return (f"model {name!r} has no setting {key!r} (config key model.{key}); valid settings: "
            f"{', '.join(sorted(settings)) or 'none'}")


def check_config(config) -> None:
    """At load time: ``model.name`` resolves and its block holds only that model's settings."""
    block = config.model
    settings = model_fields(block.name)
    foreign = [key for key in block if key != "name" and key not in settings]
    if foreign:
        raise ModelConfigError(
            _no_setting(block.name, foreign[0], settings) + f". A model's name chooses its settings: "
            f"--config.model.name={block.name} (or dtx.override(config, **{{'model.name': {block.name!r}}})) replaces "
            "the block with that model's defaults, then --config.model.KEY=VALUE applies; an experiment file "
            f"assigns the whole block, config.model = ConfigDict(dict(name={block.name!r}, ...))")
    policy = config.remat.policy if "remat" in config else "none"
    check_policy(policy)
    if policy != "none" and not takes_remat(block.name):
        raise ModelConfigError(_no_remat(block.name, policy))
    if not is_import_path(block.name):  # your own class checks its own fields
        for key, default in settings.items():
            if isinstance(default, dict):  # a nested block (the transformer's moe), as far as the block sets it
                for inner, value in default.items():
                    _check_integers(f"model.{key}.{inner}", (block.get(key) or {}).get(inner, value), value)
            else:
                _check_integers(f"model.{key}", block.get(key, default), default)
    if isinstance(settings.get("moe"), dict) and block.get("moe") is not None:
        check_moe_config(config)
    if block.name == "transformer":
        check_transformer_config(config)


def check_transformer_config(config) -> None:
    """The transformer's modern settings (``model.norm``, ``positions``, ``mlp``, ``num_kv_heads``, ...): values it
    takes, and a layout that runs them — Megatron's tensor split and pipeline stages refuse them, naming the key
    (:func:`dtx.models.transformer.layout_refusal`)."""
    try:
        check_modern(config.model)
    except ValueError as error:
        raise ModelConfigError(str(error)) from None
    parallel = config.parallel.name if "parallel" in config else "data"
    split = config.model_axis.split if "model_axis" in config else ""
    axes = [name for name, _ in config.get("mesh", ())]
    refusal = layout_refusal(config.model, megatron=parallel == "tensor" or split == "megatron",
                             stages=parallel == "pipeline" or "stage" in axes)
    if refusal:
        raise ModelConfigError(refusal)


# What a mixture of experts composes with today: data replicas (data, node, local, fsdp) under these layouts, and
# an 'expert' axis (dtx.parallel.expert: a replica axis for the other layers; the data preset composes it into the
# expert layout). Tensor-split experts, pipeline stages and context splits are not built yet.
MOE_LAYOUTS = ("data", "zero1", "zero2", "fsdp")


def check_moe_config(config) -> None:
    """``model.moe``: settings that can route (:func:`dtx.models.moe.check_settings`), on a mesh and layout that
    carry them — every axis a data-replica axis, ``parallel.name`` one of :data:`MOE_LAYOUTS`."""
    moe = _nested(model_class(config.model.name), "moe", config.model.moe)
    try:
        check_moe(moe)
    except ValueError as error:
        raise ModelConfigError(str(error)) from None
    if not moe.experts:
        return
    layout = config.parallel.name if "parallel" in config else "data"
    if layout not in MOE_LAYOUTS:
        raise ModelConfigError(f"model.moe.experts={moe.experts} with parallel.name={layout!r}: a mixture of experts "
                               f"runs under {', '.join(MOE_LAYOUTS)} (an 'expert' mesh axis splits its experts; no "
                               "tensor-split experts or pipeline stages yet); use --config.parallel.name=data, "
                               "or --config.model.moe.experts=0")
    axes = [name for name, _ in config.get("mesh", ()) if name in mesh_lib.AXES]
    others = [name for name in axes if not mesh_lib.AXES[name].replicas]
    if others and not any(mesh_lib.AXES[name].parallelism == "expert" for name in axes):  # else: compose's reason
        raise ModelConfigError(f"model.moe.experts={moe.experts} on a mesh with the {others[0]!r} axis: a mixture of "
                               "experts runs on data-replica axes (data, node, local, fsdp) and an 'expert' axis "
                               "only so far; use "
                               "--config.mesh='((\"data\", -1),)', or --config.model.moe.experts=0")


def _integer(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_integers(key: str, value, default) -> None:
    """A width, count or size (an integer, or a tuple of them, by its default) must be one: ``2.5``,
    ``"a"``, ``None`` or ``True`` would reach flax as a shape, or silently train a width of 1."""
    if _integer(default) and not _integer(value):
        raise ModelConfigError(f"{key}={value!r} must be an integer (a width, count or size), e.g. "
                               f"--config.{key}={default}")
    sequence = isinstance(default, (tuple, list)) and default and all(_integer(v) for v in default)
    if sequence and not (isinstance(value, (tuple, list)) and all(_integer(v) for v in value)):
        example = "(" + ", ".join(map(str, default)) + ("," if len(default) == 1 else "") + ")"
        raise ModelConfigError(f"{key}={value!r} must be a tuple of integers (widths or sizes), e.g. "
                               f"--config.{key}='{example}'")


register_family("model", model_fields, replaces=True)
register_check(check_config)
