"""Text from a trained language model: ``dtx generate``.

    dtx generate WORKDIR --prompt TEXT [--max-tokens N] [--temperature T] [--top-k K] [--top-p P] [--seed S]
                 [--step N] [--no-cache]

The run is rebuilt from ``WORKDIR/config.json`` and a checkpoint restored exactly as ``dtx eval`` does
(:func:`dtx.run.evaluate.restore`: every integrity check of a resume applies), or ``WORKDIR`` is a ``dtx export``
folder (``model.json`` and ``variables.msgpack``). The prompt is encoded by the run's tokenizer
(``dataset.tokenizer``: UTF-8 bytes, or the run's cached byte-level BPE, :mod:`dtx.data.tokenizer`).

Decoding is autoregressive with a key/value cache (the zoo transformer's ``decode`` mode, flax's ``cache``
collection): each new token costs one position's forward pass, the keys and values of the earlier positions read
from the cache (Vaswani et al. 2017's decoder run incrementally; Pope et al. 2022, arXiv 2211.05102, §2). The
prompt is fed through the same one-position step. ``--no-cache`` recomputes the whole sequence for every token,
the reference the cached decoding is tested against (the same tokens).

Each next token is drawn from the last position's logits (:func:`choose`): greedy (``temperature 0``, the
default), or sampled at ``temperature`` from the ``top_k`` most likely tokens (Fan et al. 2018, arXiv
1805.04833) and the smallest set whose probability reaches ``top_p`` (nucleus sampling, Holtzman et al. 2020,
arXiv 1904.09751), with a key from ``seed`` and the token's index, so a seed gives the same text.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np


class GenerateError(ValueError):
    """A model, prompt or setting generation cannot take; the message names the fix."""


def filter_logits(logits, top_k: int = 0, top_p: float = 1.0):
    """``logits`` (the last axis a vocabulary) with every token outside the ``top_k`` most likely (``0``: all) and
    outside the smallest most-likely set whose probability reaches ``top_p`` (``1``: all) set to ``-inf``; ties at
    the ``k``-th logit are kept."""
    if top_k:
        kth = jnp.sort(logits, axis=-1)[..., -top_k, None]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p < 1.0:
        order = jnp.argsort(-logits, axis=-1)
        probs = jax.nn.softmax(jnp.take_along_axis(logits, order, axis=-1), axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # the probability of the more likely tokens
        keep_sorted = before < top_p  # a token is kept while the set before it has not reached top_p
        keep = jnp.take_along_axis(keep_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back in vocabulary order
        logits = jnp.where(keep, logits, -jnp.inf)
    return logits


def choose(logits, key, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0):
    """The next token from one position's ``logits``: the most likely (``temperature 0``), or drawn with ``key`` from
    the softmax of ``logits / temperature`` over :func:`filter_logits`'s tokens."""
    if not temperature:
        return jnp.argmax(logits, axis=-1)
    return jax.random.categorical(key, filter_logits(logits.astype(jnp.float32) / temperature, top_k, top_p))


def check_settings(max_tokens: int, temperature: float, top_k: int, top_p: float, prompt_length: int,
                   max_len: int | None) -> None:
    """Refuse, naming the flag, what cannot generate: a negative count or temperature, ``top_p`` outside (0, 1],
    an empty prompt, and a prompt with its new tokens longer than the model's positions."""
    if max_tokens < 1:
        raise GenerateError(f"--max-tokens {max_tokens}: generate at least 1 token")
    if temperature < 0:
        raise GenerateError(f"--temperature {temperature}: use 0 (greedy) or a positive temperature")
    if top_k < 0 or not 0 < top_p <= 1:
        raise GenerateError(f"--top-k {top_k} --top-p {top_p}: top-k is a count (0: every token), top-p a "
                            "probability in (0, 1]")
    if prompt_length < 1:
        raise GenerateError("--prompt is empty: give the text to continue (at least one token)")
    if max_len is not None and prompt_length + max_tokens > max_len:
        raise GenerateError(f"the prompt's {prompt_length} tokens and --max-tokens {max_tokens} exceed the model's "
                            f"{max_len} positions (model.max_len): shorten the prompt or ask for at most "
                            f"{max(max_len - prompt_length, 0)} tokens")


def generate(model, params, prompt, max_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, cache: bool = True) -> np.ndarray:
    """``max_tokens`` token ids continuing ``prompt`` (int ids, one sequence) from ``model`` (the zoo transformer
    or any module with its ``decode`` and ``positions=`` interface) with ``params``: cached decoding, one
    position per step, or (``cache=False``) the whole sequence recomputed for each token (module docstring)."""
    prompt = np.asarray(prompt, np.int32).reshape(-1)
    params = jax.tree.map(jnp.asarray, params)  # device arrays: a host array cannot be indexed by a traced position
    max_len = getattr(model, "max_len", None)
    check_settings(max_tokens, temperature, top_k, top_p, prompt.shape[0], max_len)
    base = jax.random.key(seed)
    pick = jax.jit(lambda logits, i: choose(logits, jax.random.fold_in(base, i), temperature, top_k, top_p))
    out = []
    if not cache:
        apply = jax.jit(lambda tokens: model.apply({"params": params}, tokens, train=False)[0, -1])
        tokens = list(prompt)
        for i in range(max_tokens):
            token = int(pick(apply(jnp.asarray([tokens], jnp.int32)), i))
            tokens.append(token)
            out.append(token)
        return np.asarray(out, np.int32)
    if not any(f.name == "decode" for f in getattr(model, "__dataclass_fields__", {}).values()):
        raise GenerateError(f"{type(model).__name__} has no decode mode (a key/value cache); use --no-cache, which "
                            "recomputes the sequence for every token")
    decoder = model.clone(decode=True)
    length = max_len or prompt.shape[0] + max_tokens
    cached = decoder.init(jax.random.key(0), jnp.zeros((1, length), jnp.int32), train=False,
                          positions=jnp.arange(length)[None])["cache"]

    @jax.jit
    def step(cached, token, position):
        logits, changed = decoder.apply({"params": params, "cache": cached}, token.reshape(1, 1), train=False,
                                        positions=position.reshape(1, 1), mutable=["cache"])
        return logits[0, -1], changed["cache"]

    for position, token in enumerate(prompt):  # the prompt through the same step, its keys and values cached
        logits, cached = step(cached, jnp.int32(token), jnp.int32(position))
    for i in range(max_tokens):
        token = pick(logits, i)
        out.append(int(token))
        if i + 1 < max_tokens:
            logits, cached = step(cached, token.astype(jnp.int32), jnp.int32(prompt.shape[0] + i))
    return np.asarray(out, np.int32)


def _tokenizer(config):
    """The run's tokenizer (:mod:`dtx.data.tokenizer`): bytes, or its cached BPE (trained again only if the cache is
    gone, from the same text: the same tokenizer)."""
    from dtx.data import datasets
    from dtx.data import tokenizer as tokenizer_lib

    block = config.dataset
    name = block.get("tokenizer", "bytes")
    if name == "bytes":
        return tokenizer_lib.Tokenizer()
    if block.name not in datasets.TEXT_DATASETS:
        raise GenerateError(f"dataset.name={block.name!r} has no text to rebuild its tokenizer from")
    train_text, _ = datasets.split_text(datasets.python_docs_text())
    folder = os.path.expanduser(block.get("data_dir", "")) or tokenizer_lib.default_cache_dir()
    return tokenizer_lib.bpe(train_text, block.vocab_size, folder, block.name)


def _from_export(folder: str):
    """``(model, params, config)`` of a ``dtx export`` folder (its ``model.json`` names the class and keywords)."""
    from dtx.run import evaluate
    from dtx.run.exportdir import MODEL_FILE, VARIABLES_FILE
    import flax.serialization

    with open(os.path.join(folder, MODEL_FILE)) as f:
        described = json.load(f)
    module, _, name = described["class"].rpartition(".")
    cls = getattr(importlib.import_module(module), name)
    kwargs = {k: (jnp.dtype(v) if k in ("dtype", "param_dtype") else v) for k, v in described["kwargs"].items()}
    model = cls(**kwargs)
    with open(os.path.join(folder, VARIABLES_FILE), "rb") as f:
        variables = flax.serialization.msgpack_restore(f.read())
    config = evaluate.config_from_json(evaluate._saved_config(described["workdir"])) \
        if os.path.isfile(os.path.join(described.get("workdir", ""), "config.json")) else None
    return model, variables["params"], config


def generate_text(workdir: str, prompt: str, max_tokens: int = 64, *, step: int | None = None, **sampling) -> str:
    """The text ``max_tokens`` tokens continue ``prompt`` with, from the run (or export) in ``workdir``
    (module docstring); ``sampling``: :func:`generate`'s ``temperature``, ``top_k``, ``top_p``, ``seed``,
    ``cache``."""
    from dtx.run import evaluate

    if os.path.isfile(os.path.join(workdir, "model.json")):
        model, params, config = _from_export(workdir)
        if config is None:
            raise GenerateError(f"{workdir} is an export whose run ({workdir}/model.json's workdir) is gone: its "
                                "tokenizer cannot be rebuilt; generate from the run's workdir instead")
    else:
        run = evaluate.restore(workdir, step=step)
        model, config = run.parts.model, run.config
        params = jax.device_get(evaluate._evaluated_variables(run)["params"])
    tokenizer = _tokenizer(config)
    ids = generate(model, params, tokenizer.encode(prompt), max_tokens, **sampling)
    return tokenizer.decode(ids)


def generate_main(argv: Sequence[str]) -> int:
    """``dtx generate WORKDIR --prompt TEXT ...`` (module docstring): print the prompt and its continuation; exit 0,
    or 2 for input it cannot take."""
    parser = argparse.ArgumentParser(prog="dtx generate", description="Continue a prompt with a trained language "
                                     "model (a run's checkpoint, or a dtx export).")
    parser.add_argument("workdir", help="a dtx train --workdir that saved checkpoints, or a dtx export --out folder")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate (default 64)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sample")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set reaching p (1: all)")
    parser.add_argument("--seed", type=int, default=0, help="the sampling key's seed")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    parser.add_argument("--no-cache", action="store_true", help="recompute the sequence for every token")
    args = parser.parse_args(argv)
    try:
        text = generate_text(args.workdir, args.prompt, args.max_tokens, step=args.step,
                             temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                             cache=not args.no_cache)
    except ValueError as error:  # GenerateError, RunError, a config's: the input's fault
        print(f"dtx generate: {error}", file=sys.stderr)
        return 2
    print(args.prompt + text)
    return 0
