"""dtx.step.pacing: a hand-written loop over dtx.paced(step) keeps one step queued behind the running one, so an
emulated CPU mesh never deadlocks; each call waits on the previous call's outputs, never its own."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import dtx
from dtx import models
from dtx.step import pacing
from dtx.data import TrainLoader


def test_a_paced_hand_loop_of_60_steps_completes(digits, mesh):
    # This loop without dtx.paced, batches placed beforehand so dispatch outruns the devices, aborts
    # in XLA:CPU's all-reduce rendezvous ("Termination timeout ... only 6 of them arrived"; measured
    # with 60 and 100 steps of this model). Paced, it keeps one step queued behind the running one.
    model = models.build_model("mlp", features=(2048,))
    tx = optax.sgd(0.1)
    example = jax.ShapeDtypeStruct(digits.train.inputs.shape, digits.train.inputs.dtype)
    state = dtx.init_train_state(model, tx, example, seed=0, mesh=mesh)
    step = dtx.paced(dtx.make_train_step(model, tx, mesh))
    loader = TrainLoader(digits.train, 64, mesh, seed=0)
    batches = [loader.batch(s) for s in range(60)]
    losses, unfinished = [], 0
    for batch in batches:
        state, out = step(state, batch)
        losses.append(out["loss"])
        unfinished += len(losses) > 1 and not losses[-2].is_ready()  # the step before has finished
    step.wait()
    assert unfinished == 0
    assert int(jax.device_get(state.step)) == 60
    assert float(np.mean(jax.device_get(losses[-5:]))) < 0.5 * float(losses[0])


def test_paced_waits_for_the_previous_call(monkeypatch):
    waited = []
    real = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda xs: waited.append([id(x) for x in xs]) or real(xs))
    step = pacing.paced(jax.jit(lambda i: {"value": i + 1}))
    outs = [step(jnp.int32(i)) for i in range(4)]
    assert waited == [[id(outs[k]["value"])] for k in range(3)]  # call k+1 waited on call k, never on itself
    step.wait()
    assert waited[-1] == [id(outs[3]["value"])]
    # in_flight=0 waits on each call's own outputs; outputs donated to the next call (a train state) are
    # gone, so the wait falls to the newer call's.
    waited.clear()
    donating = pacing.paced(jax.jit(lambda x: x + 1, donate_argnums=0), in_flight=1)
    x = donating(jnp.zeros(3))
    y = donating(x)
    assert x.is_deleted() and waited == [[id(y)]]
    with pytest.raises(ValueError, match="in_flight=-1"):
        pacing.paced(lambda: None, in_flight=-1)
