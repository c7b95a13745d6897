"""The loop a user would write by hand: single device, flax + optax, digits, no dtx.

The baseline the default experiment is compared with (BENCHMARKS.md). Same data
split, model, optimizer, batch size and epochs as experiments/digits_mlp.py.

    python benchmarks/plain_loop.py [--eval-each-epoch]

``--eval-each-epoch`` prints the test accuracy after every epoch (flushed), which
``benchmarks/time_to_accuracy.py`` times.
"""

import argparse
import time

START = time.perf_counter()

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = x.reshape((x.shape[0], -1))
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(10)(x)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--eval-each-epoch", action="store_true")
    args = parser.parse_args()
    digits = load_digits()
    images = (digits.images / 16.0).astype(np.float32)[..., None]
    labels = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(labels))
    train_idx, test_idx = order[:-360], order[-360:]
    x_train, y_train, x_test, y_test = images[train_idx], labels[train_idx], images[test_idx], labels[test_idx]

    model = MLP()
    params = model.init(jax.random.key(0), x_train[:1])
    tx = optax.adam(2e-3)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, x, y):
        def loss_fn(p):
            logits = model.apply(p, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    batch = 128
    steps_per_epoch = len(y_train) // batch
    rng = np.random.default_rng(0)
    for epoch in range(20):
        perm = rng.permutation(len(y_train))
        for i in range(steps_per_epoch):
            idx = perm[i * batch : (i + 1) * batch]
            params, opt_state, loss = train_step(params, opt_state, x_train[idx], y_train[idx])
        if args.eval_each_epoch:
            accuracy = float(jnp.mean(jnp.argmax(model.apply(params, x_test), -1) == y_test))
            print(f"epoch {epoch + 1} test_accuracy {accuracy:.4f}", flush=True)
    accuracy = float(jnp.mean(jnp.argmax(model.apply(params, x_test), -1) == y_test))
    print(f"test_accuracy {accuracy:.4f}  wall {time.perf_counter() - START:.2f}s")


if __name__ == "__main__":
    main()
