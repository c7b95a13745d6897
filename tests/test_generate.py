"""Generation (dtx.run.generate, ``dtx generate``): cached decoding is the recomputed one, sampling is its formulas.

Checked: greedy decoding with the key/value cache (the zoo transformer's ``decode`` mode, one position a step) gives
the tokens of recomputing the whole sequence for every token, and the cached step's logits at every position are
the full forward pass's; the top-k / top-p filter against a numpy reference; a seed gives the same sample and
another seed another; bad settings refused naming the flag; ``dtx generate`` on a trained run's checkpoint and on
its export prints the prompt and the same continuation, ``--no-cache`` the same.

Hand-breaks: the decode step fed position 0 for every token (``positions=`` left out) -> the cached test fails; the
top-p set cut before the token that reaches ``p`` (the cumulative sum with the token itself below ``p``) ->
the filter test fails.
"""

import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dtx import models
from dtx.run import generate as gen
from dtx.tools.cli import main

LM = dict(num_layers=2, d_model=32, num_heads=4, mlp_ratio=2, max_len=24, num_classes=64)


@pytest.fixture(scope="module")
def lm():
    model = models.build_model("transformer", **LM)
    params = model.init(jax.random.key(1), jnp.zeros((1, LM["max_len"]), jnp.int32))["params"]
    # Larger than the initialisation's 0.02: logits spread enough that no greedy choice is a rounding tie.
    params = jax.tree.map(lambda p: p * 8 if p.ndim > 1 else p, params)
    return model, params


def test_cached_decoding_is_recomputing(lm):
    """12 greedy tokens after a 5-token prompt: the cached decoding's equal the recomputed ones; and the cache's
    logits at each of the 17 positions equal the full sequence's forward pass (tolerance: float32 rounding of
    sums over the 32-wide stream and the 17 positions, at the logits' scale)."""
    from numerics import sum_atol

    model, params = lm
    prompt = np.array([3, 17, 5, 60, 1])
    cached = gen.generate(model, params, prompt, 12)
    np.testing.assert_array_equal(cached, gen.generate(model, params, prompt, 12, cache=False))
    tokens = np.concatenate([prompt, cached])
    full = model.apply({"params": params}, jnp.asarray(tokens[None]), train=False)[0]
    decoder = model.clone(decode=True)
    cache = decoder.init(jax.random.key(0), jnp.zeros((1, LM["max_len"]), jnp.int32),
                         positions=jnp.arange(LM["max_len"])[None])["cache"]
    steps = []
    for position, token in enumerate(tokens):
        logits, changed = decoder.apply({"params": params, "cache": cache}, jnp.asarray([[token]]),
                                        positions=jnp.asarray([[position]]), mutable=["cache"])
        cache = changed["cache"]
        steps.append(logits[0, 0])
    np.testing.assert_allclose(np.stack(steps), full, rtol=0,
                               atol=sum_atol(full, terms=LM["d_model"] * len(tokens), depth=2 * LM["num_layers"]))


def _reference_filter(logits, top_k, top_p):
    """numpy: the top-k and nucleus sets of one position's logits, the rest -inf."""
    out = logits.astype(np.float64).copy()
    if top_k:
        out[out < np.sort(out)[-top_k]] = -np.inf
    if top_p < 1:
        order = np.argsort(-out, kind="stable")
        probs = np.exp(out[order] - out[order][0])
        probs /= probs.sum()
        kept, total = [], 0.0
        for index, p in zip(order, probs):
            if total >= top_p:
                break
            kept.append(index)
            total += p
        mask = np.full(out.shape, -np.inf)
        mask[kept] = 0
        out = out + mask
    return out


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (7, 0.8), (1, 1.0)])
def test_the_filter_is_top_k_and_nucleus(top_k, top_p):
    logits = np.random.default_rng(top_k).normal(size=40).astype(np.float32) * 2
    got = np.asarray(gen.filter_logits(jnp.asarray(logits), top_k, top_p))
    want = _reference_filter(logits, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(want))
    np.testing.assert_allclose(got[np.isfinite(got)], want[np.isfinite(want)], rtol=1e-6)


def test_a_seed_gives_the_same_sample(lm):
    model, params = lm
    prompt = np.array([3, 17, 5])
    a = gen.generate(model, params, prompt, 10, temperature=1.0, top_k=20, seed=4)
    assert np.array_equal(a, gen.generate(model, params, prompt, 10, temperature=1.0, top_k=20, seed=4))
    assert not np.array_equal(a, gen.generate(model, params, prompt, 10, temperature=1.0, top_k=20, seed=5))


@pytest.mark.parametrize("settings, match", [
    (dict(max_tokens=0), "--max-tokens 0"), (dict(temperature=-1.0), "--temperature -1.0"),
    (dict(top_p=0.0), "top-p a probability"), (dict(max_tokens=30), "exceed the model's 24 positions"),
])
def test_bad_settings_are_refused_naming_the_flag(lm, settings, match):
    model, params = lm
    arguments = dict(max_tokens=4) | settings
    with pytest.raises(gen.GenerateError, match=match):
        gen.generate(model, params, np.array([1, 2]), arguments.pop("max_tokens"), **arguments)


EXPERIMENT = textwrap.dedent('''
    """tiny_lm made tinier and shorter, for tests/test_generate.py."""
    from dtx.experiments import tiny_lm


    def get_config():
        config = tiny_lm.get_config()
        config.dataset.seq_len, config.global_batch_size, config.num_steps = 16, 16, 4
        config.model.update(num_layers=1, d_model=16, num_heads=2, mlp_ratio=2, max_len=32)
        config.eval_batch_size, config.checkpoint.every_steps, config.progress = 256, 4, False
        config.optimizer.warmup_steps = 1
        return config
''')


def test_dtx_generate_continues_a_prompt_from_a_run_and_its_export(tmp_path, capsys):
    (tmp_path / "lm.py").write_text(EXPERIMENT)
    assert main(["train", str(tmp_path / "lm.py"), "--workdir", str(tmp_path / "run")]) == 0
    assert main(["export", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    printed = []
    for args in ([str(tmp_path / "run")], [str(tmp_path / "run"), "--no-cache"], [str(tmp_path / "out")]):
        assert main(["generate", *args, "--prompt", "for x in", "--max-tokens", "12"]) == 0
        printed.append(capsys.readouterr().out.strip())
    assert printed[0].startswith("for x in") and len(printed[0].encode()) >= len("for x in") + 1
    assert printed[0] == printed[1] == printed[2]
    assert main(["generate", str(tmp_path / "run"), "--prompt", "x", "--max-tokens", "40"]) == 2
    assert "exceed the model's 32 positions" in capsys.readouterr().err
