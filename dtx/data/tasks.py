"""Tasks: what a model's outputs are scored against — a run's loss and metrics.

A :class:`Task` is a few pure functions the step factories bind at construction
(``make_train_step(..., task=)``, ``make_eval_step(..., task=)``, ``dtx.train(..., task=)``,
or ``config.task`` in an experiment file), like the optimizer: the step never sees the
config. Each function scores *elements*: one per example for classification and
regression, one per token for language modelling. The step turns element scores into
exact global averages (sums over every real element of the global batch divided by
their count), so N devices compute what one device would, padding included.

Built-in tasks (:data:`TASKS`):

* ``classification`` (the default): softmax cross-entropy on integer labels, with
  optional label smoothing (Szegedy et al., *Rethinking the Inception Architecture for
  Computer Vision*, CVPR 2016, §7); metric ``accuracy``.
* ``regression``: mean squared error on float targets (per example, averaged over the
  target's features); metric ``mae`` (mean absolute error).
* ``next_token``: token-level cross-entropy for language models whose outputs are
  ``(batch, time, vocab)`` logits and labels ``(batch, time)`` token ids; tokens equal to
  ``pad_id`` are not scored; optional label smoothing as for classification. Metric
  ``accuracy`` over the scored tokens; evaluation adds ``perplexity`` = exp(mean unsmoothed
  cross-entropy per scored token) (Jelinek et al. 1977; the usual LM figure). With label
  smoothing ``test_loss`` is the smoothed training objective, not that cross-entropy:
  evaluation then also sums the unsmoothed one (``test_nll``), and ``perplexity`` = exp(``test_nll``).
  On a text dataset evaluation also records ``test_bits_per_byte`` (:func:`count_bytes`), which
  compares across tokenizers as perplexity per token does not.

With ``label_smoothing > 0`` the loss, ``loss`` in the training records and ``test_loss`` are the
smoothed objective (classification and next_token alike); only ``next_token`` reports a figure
(``perplexity``) that must be the unsmoothed cross-entropy, so only it sums that at evaluation.

Your own task: ``Task(name, loss=..., metrics=..., valid=...)`` with functions of the same
shapes (see :class:`Task`), passed as ``dtx.train(..., task=)``, or a function returning one named by
import path, ``--config.task.name=package.module:function`` (its keyword parameters become ``task.*``
settings, :mod:`dtx.config.parts`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from dtx.config import (
    ConfigError, check_block, declared_settings, is_import_path, parameters, refuse_foreign, register_check,
    register_family, resolve,
)

Array = Any


class TaskError(ValueError):
    """Labels a task cannot score, or a task setting that cannot work; the message says the fix."""


class Task(NamedTuple):
    """A loss and its metrics, scored per element.

    Attributes:
      name: shown in errors and records.
      loss: ``(outputs, labels) -> losses``, float32, one per element (shape ``labels.shape``
        for classification and next-token, ``(batch,)`` for regression).
      metrics: ``(outputs, labels) -> {name: values}``, each shaped like ``losses``; booleans
        (e.g. a correct prediction) are summed as exact integers.
      valid: ``labels -> bool``, shaped like ``losses``: which elements count (``False`` for
        padding). ``None``: every element counts, and averages need no extra communication.
      summarize: host side, after evaluation: ``{test_loss, test_<metric>, ...} -> extra records``
        (``next_token`` adds ``perplexity``).
      check: host side, before anything compiles: ``(labels shape, labels dtype) -> None``,
        raising :class:`TaskError` for labels this task cannot score.
      eval_metrics: ``(outputs, labels) -> {name: values}`` like ``metrics``, but summed at evaluation
        only (records ``test_<name>``), never computed in the train step (``next_token`` with label
        smoothing: ``nll``, the unsmoothed cross-entropy per token that ``perplexity`` exponentiates).
      scores_tokens: the elements are the tokens of ``(N, T)`` labels and the unsmoothed loss (``test_nll``,
        else ``test_loss``) is their cross-entropy in nats, so a text dataset's bytes per token turn it into
        bits per byte (:func:`count_bytes`; ``next_token``).
    """

    name: str
    loss: Callable[[Array, Array], Array]
    metrics: Callable[[Array, Array], dict[str, Array]]
    valid: Callable[[Array], Array] | None = None
    summarize: Callable[[dict], dict] | None = None
    check: Callable[[tuple, np.dtype], None] | None = None
    eval_metrics: Callable[[Array, Array], dict[str, Array]] | None = None
    scores_tokens: bool = False


def cross_entropy(logits: Array, labels: Array, label_smoothing: float = 0.0) -> Array:
    """Softmax cross-entropy per element, in float32 whatever the compute dtype.

    With ``label_smoothing = a`` the target is ``(1 - a) * one_hot(label) + a / K``, which
    expands to ``(1 - a) * nll + a * mean_k(-log p_k)``: no ``(…, K)`` one-hot is built.
    """
    logits = logits.astype(jnp.float32)
    if not label_smoothing:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    log_p = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(log_p, labels[..., None], axis=-1)[..., 0]
    return (1.0 - label_smoothing) * nll - label_smoothing * log_p.mean(axis=-1)


def classification(label_smoothing: float = 0.0) -> Task:
    """Integer class labels ``(batch,)``, logits ``(batch, classes)``: cross-entropy and accuracy."""
    _check_smoothing(label_smoothing)

    def loss(logits, labels):
        return cross_entropy(logits, labels, label_smoothing)

    def metrics(logits, labels):
        return {"accuracy": jnp.argmax(logits, -1) == labels}

    def check(shape, dtype):
        if not np.issubdtype(dtype, np.integer):
            raise TaskError(f"task 'classification' needs integer class ids as labels, got {np.dtype(dtype).name}; "
                            "for float targets use the regression task (--config.task.name=regression, "
                            "dtx.data.tasks.regression())")
        if len(shape) != 1:
            raise TaskError(f"task 'classification' needs labels of shape (N,), got {tuple(shape)}; for sequences "
                            "of token ids use the next_token task (--config.task.name=next_token)")

    return Task("classification", loss, metrics, check=check)


def regression() -> Task:
    """Float targets ``(batch,)`` or ``(batch, ...)``: mean squared error, metric ``mae``.

    The model's outputs must hold one value per target entry (``(batch, 1)`` for scalar
    targets: a model built from the config gets that many outputs).
    """

    def error(outputs, labels):
        if int(np.prod(outputs.shape[1:])) != int(np.prod(labels.shape[1:])):
            raise TaskError(f"task 'regression': the model outputs {tuple(outputs.shape[1:])} values per example "
                            f"but the targets have shape {tuple(labels.shape[1:])}; give the model "
                            f"{int(np.prod(labels.shape[1:]))} outputs (num_classes for dtx's models)")
        diff = outputs.astype(jnp.float32).reshape(labels.shape) - labels.astype(jnp.float32)
        return diff.reshape(diff.shape[0], -1)

    def loss(outputs, labels):
        return jnp.mean(jnp.square(error(outputs, labels)), axis=1)

    def metrics(outputs, labels):
        return {"mae": jnp.mean(jnp.abs(error(outputs, labels)), axis=1)}

    def check(shape, dtype):
        if not np.issubdtype(dtype, np.floating):
            raise TaskError(f"task 'regression' needs float targets as labels, got {np.dtype(dtype).name}; "
                            "for class ids use the classification task (the default), or cast the targets "
                            "with labels.astype(np.float32)")

    return Task("regression", loss, metrics, check=check)


def next_token(pad_id: int | None = None, label_smoothing: float = 0.0) -> Task:
    """Language modelling: logits ``(batch, time, vocab)``, labels ``(batch, time)`` token ids.

    Label ``t`` of a sequence is the token that follows input ``t`` (the caller shifts:
    ``inputs = tokens[:, :-1]``, ``labels = tokens[:, 1:]``). Tokens equal to ``pad_id``
    are not scored (``None`` or negative, as ``config.task.pad_id=-1``: every token is); the mean
    loss is over the scored tokens of the whole global batch, however unevenly padding is spread
    over devices.

    With ``label_smoothing > 0`` the loss (and ``test_loss``) is the smoothed objective; evaluation
    also sums the unsmoothed cross-entropy per scored token (``test_nll``), and ``perplexity`` is
    exp of that, whatever the smoothing (without smoothing ``test_nll`` would equal ``test_loss`` and
    is not recorded).
    """
    _check_smoothing(label_smoothing)
    if pad_id is not None and (isinstance(pad_id, bool) or not isinstance(pad_id, (int, np.integer))):
        raise TaskError(f"next_token: pad_id={pad_id!r} must be an integer token id, or None for no padding")
    if pad_id is not None and pad_id < 0:
        pad_id = None

    def valid(labels):
        return labels != pad_id

    def token_cross_entropy(logits, labels, smoothing):
        if pad_id is None:
            return cross_entropy(logits, labels, smoothing)
        # Padding ids may lie outside the vocabulary: score a safe id there, then zero it.
        safe = jnp.where(valid(labels), labels, 0)
        return jnp.where(valid(labels), cross_entropy(logits, safe, smoothing), 0.0)

    def loss(logits, labels):
        return token_cross_entropy(logits, labels, label_smoothing)

    def metrics(logits, labels):
        return {"accuracy": jnp.argmax(logits, -1) == labels}

    def nll(logits, labels):  # evaluation only, and only when the loss is smoothed
        return {"nll": token_cross_entropy(logits, labels, 0.0)}

    def summarize(record):
        # Perplexity is exp of the unsmoothed cross-entropy; test_loss is that only without smoothing.
        mean_nll = record["test_nll"] if label_smoothing else record["test_loss"]
        return {"perplexity": math.exp(min(mean_nll, 700.0))}  # exp overflows a float past ~709

    def check(shape, dtype):
        if not np.issubdtype(dtype, np.integer) or len(shape) < 2:
            raise TaskError(f"task 'next_token' needs labels of token ids shaped (N, T), got {np.dtype(dtype).name} "
                            f"{tuple(shape)}; build them as inputs = tokens[:, :-1], labels = tokens[:, 1:]")

    return Task("next_token", loss, metrics, valid if pad_id is not None else None, summarize, check,
                nll if label_smoothing else None, scores_tokens=True)


def count_bytes(task: Task, token_bytes: np.ndarray | None) -> Task:
    """``task`` with bits per byte at evaluation, for a text dataset whose token id ``i`` spells
    ``token_bytes[i]`` UTF-8 bytes (:attr:`dtx.data.datasets.Dataset.token_bytes`); ``task`` itself for other
    data or a task that does not score tokens (:attr:`Task.scores_tokens`).

    Evaluation sums, over the scored tokens, the bytes each label token spells (``test_bytes_per_token``: their
    mean, exact integer sums), and records ``test_bits_per_byte`` = total nats / ln 2 / total bytes = mean
    cross-entropy per token / ln 2 / bytes per token: a figure that does not depend on the tokenizer, so runs
    with different vocabularies compare (GPT-2 reports it for enwik8 beside perplexities per token: Radford et
    al. 2019, Table 3). With one byte per token (``dataset.tokenizer=bytes``) it is ``test_loss / ln 2``
    exactly. Only evaluation changes: the train step is the same program.
    """
    if token_bytes is None or not task.scores_tokens:
        return task
    table = np.asarray(token_bytes, np.int32)
    own_metrics, own_summary = task.eval_metrics, task.summarize

    def eval_metrics(outputs, labels):
        # Padding ids may lie outside the table: look up a safe id (padding is not scored anyway).
        spelled = jnp.asarray(table)[jnp.clip(labels, 0, len(table) - 1)]
        return {**(own_metrics(outputs, labels) if own_metrics else {}), "bytes_per_token": spelled}

    def summarize(record):
        nats = record.get("test_nll", record["test_loss"])  # the unsmoothed cross-entropy per token
        extra = own_summary(record) if own_summary else {}
        return {**extra, "test_bits_per_byte": nats / math.log(2) / record["test_bytes_per_token"]}

    return task._replace(eval_metrics=eval_metrics, summarize=summarize)


TASKS: dict[str, Callable[..., Task]] = {
    "classification": classification, "regression": regression, "next_token": next_token,
}


def task_settings(name: str | None = None) -> dict[str, tuple[str, ...]]:
    """Each task's settings (keys of ``config.task``): its factory's parameters; with ``name`` an import path
    (``package.module:function``), that function's too."""
    taken = {task: declared_settings(factory) for task, factory in TASKS.items()}
    if is_import_path(name):
        taken[name] = tuple(user_task_settings(name))
    return taken


def user_task_settings(name: str) -> dict:
    """Your task factory ``package.module:function``'s settings with their defaults (a task block's keys)."""
    return parameters(_user_factory(name), f"task.name={name!r}")


def _user_factory(name: str) -> Callable[..., Task]:
    factory = resolve(name, "task.name")
    if not callable(factory):
        raise ConfigError(f"task.name={name!r} is {type(factory).__name__} {factory!r}; name a function that "
                          "returns a dtx.data.tasks.Task")
    return factory


def make_task(name: str = "classification", **settings) -> Task:
    """The task ``config.task`` describes: ``name`` built from ``settings``, keys of ``config.task`` that it
    takes (:func:`task_settings`; ``pad_id < 0``: no padding); a setting it does not take raises
    :class:`TaskError`. ``name`` may be your function returning a :class:`Task`, ``package.module:function``."""
    if is_import_path(name):
        try:
            factory = _user_factory(name)
        except ConfigError as e:
            raise TaskError(str(e)) from None
        refuse_foreign("task", name, settings, task_settings(name), TaskError)
        task = factory(**settings)
        if not isinstance(task, Task):
            raise TaskError(f"task.name={name!r} returned {type(task).__name__}, not a dtx.data.tasks.Task; return "
                            "Task(name, loss=..., metrics=...)")
        return task
    if name not in TASKS:
        raise TaskError(f"task.name={name!r} is unknown; choose one of {list(TASKS)} (or your own function "
                        "returning a dtx.data.tasks.Task, as package.module:function)")
    refuse_foreign("task", name, settings, task_settings(), TaskError)
    return TASKS[name](**settings)


def _check_smoothing(value: float) -> None:
    if not 0.0 <= value < 1.0:
        raise TaskError(f"label_smoothing={value!r} must be in [0, 1) (e.g. 0.1); fix task.label_smoothing")


# ----------------------------------------------------------------------- inside the step


def batch_mean_terms(task: Task, outputs: Array, labels: Array, denominator: Array | None):
    """A (micro-)batch's share of the step's means: ``(loss, {metric: value})``.

    ``denominator`` ``None``: the mean over this batch's elements (all count). Otherwise
    the sums over its valid elements divided by ``denominator``, which the step chooses so
    that averaging the shares over devices and micro-batches gives the global mean.
    """
    losses = task.loss(outputs, labels)
    values = task.metrics(outputs, labels)
    if denominator is None:
        return losses.mean(), {k: v.astype(jnp.float32).mean() for k, v in values.items()}
    valid = task.valid(labels)
    share = lambda x: jnp.where(valid, x.astype(jnp.float32), 0.0).sum() / denominator  # noqa: E731
    return share(losses), {k: share(v) for k, v in values.items()}


def valid_count(task: Task, labels: Array) -> Array:
    """How many elements of ``labels`` are scored (int32)."""
    return task.valid(labels).sum(dtype=jnp.int32)


def eval_sums(task: Task, outputs: Array, labels: Array, mask: Array) -> dict:
    """Sums over the real (``mask``) examples' valid elements: ``loss_sum``, ``count`` (elements),
    ``examples`` and ``<metric>_sum`` for the task's ``metrics`` and ``eval_metrics`` — int32 for
    boolean and integer metrics, so the host's totals are exact."""
    losses = task.loss(outputs, labels)
    scored = mask.reshape(mask.shape + (1,) * (losses.ndim - 1))
    scored = jnp.broadcast_to(scored, losses.shape)
    if task.valid is not None:
        scored = jnp.logical_and(scored, task.valid(labels))
    sums = {"loss_sum": jnp.where(scored, losses, 0.0).sum(), "count": scored.sum(dtype=jnp.int32),
            "examples": mask.sum(dtype=jnp.int32)}
    values_of = dict(task.metrics(outputs, labels))
    if task.eval_metrics is not None:
        values_of.update(task.eval_metrics(outputs, labels))
    for name, values in values_of.items():
        if values.dtype == jnp.bool_:
            sums[f"{name}_sum"] = jnp.logical_and(scored, values).sum(dtype=jnp.int32)
        elif jnp.issubdtype(values.dtype, jnp.integer):  # counts (bytes per token): exact
            sums[f"{name}_sum"] = jnp.where(scored, values, 0).sum(dtype=jnp.int32)
        else:
            sums[f"{name}_sum"] = jnp.where(scored, values.astype(jnp.float32), 0.0).sum()
    return sums


def summarize(sums: list[dict], task: Task | None = None) -> dict:
    """Host side: exact test records from the eval step's per-batch sums.

    ``test_loss`` (the training objective, label smoothing included) and ``test_<metric>``
    (``metrics`` and ``eval_metrics``, e.g. ``test_nll``) are means over the scored elements
    (float64 sums, integer counts); ``test_examples`` counts examples, ``test_tokens`` the
    scored elements where they differ (sequences); then the task's own records (``perplexity``).
    """
    host = [{k: np.asarray(v) for k, v in s.items()} for s in sums]
    count = sum(int(s["count"]) for s in host)
    examples = sum(int(s.get("examples", s["count"])) for s in host)
    if not count:
        raise TaskError("evaluation scored no element: the test split is empty or entirely padding")
    total = lambda key: sum(int(s[key]) if s[key].dtype.kind in "iu" else np.float64(s[key]) for s in host)  # noqa: E731
    record = {f"test_{k[:-4]}": float(total(k)) / count for k in host[0] if k.endswith("_sum") and k != "loss_sum"}
    record.update(test_loss=float(total("loss_sum")) / count, test_examples=examples)
    if count != examples:
        record["test_tokens"] = count
    task = task or classification()
    if task.summarize is not None:
        record.update(task.summarize(record))
    return record


@register_check
def check_config(config) -> None:
    """The task block names a known task with settings that apply to it (those :func:`make_task` takes)."""
    task = config.task
    if task.name not in TASKS and not is_import_path(task.name):
        raise ConfigError(f"task.name={task.name!r} is unknown; choose one of {list(TASKS)} (or your own function "
                          "returning a dtx.data.tasks.Task, as package.module:function, or dtx.train(..., task=))")
    if not 0 <= task.label_smoothing < 1:
        raise ConfigError(f"task.label_smoothing={task.label_smoothing!r} must be in [0, 1), e.g. 0.1")
    check_block(config, "task", task_settings(task.name))
    if config.dataset.seq_len < 1:
        raise ConfigError(f"dataset.seq_len={config.dataset.seq_len} must be >= 1 (tokens per example)")


register_family("task", user_task_settings, replaces=False)  # task.name=package.module:function adds its settings
