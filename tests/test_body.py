"""dtx.step.body: the per-worker body's named jobs on one worker (no axes): the step's keys, the averages and the
loss-scaling skip, by hand. The body end to end, both drivers against one device, is tests/test_step.py."""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from dtx import strategies
from dtx.step import body
from dtx.comm.costmodel import Traffic


class _State(NamedTuple):
    params: Any
    model_state: Any


def test_step_keys_carry_a_fresh_rng_and_a_shared_key_apart_from_the_workers():
    rng = jax.random.key_data(jax.random.key(7))
    keyed = type("Keyed", (), {"rng": rng})()  # step_keys reads only the state's rng
    carried, step_rng, shared, index = body.step_keys(keyed, axes=())
    again = body.step_keys(keyed, axes=())
    assert all(np.array_equal(jax.random.key_data(a), jax.random.key_data(b)) for a, b in zip((carried, step_rng,
                                                                                              shared), again[:3]))
    datas = [np.asarray(jax.random.key_data(k)).tobytes() for k in (carried, step_rng, shared)]
    assert len(set(datas)) == 3 and datas[0] != np.asarray(rng).tobytes() and int(index) == 0


def test_averages_on_one_worker_send_nothing_and_report_overflow():
    mean = body.averages((), jnp.float32(2.0), {"accuracy": jnp.float32(0.5)}, jnp.bool_(False), {"bn": 1.0})
    assert (float(mean.loss), float(mean.values["accuracy"]), bool(mean.finite)) == (2.0, 0.5, False)
    assert mean.traffic == Traffic(0, 0) and mean.model_state == {"bn": 1.0}
    assert body.averages((), jnp.float32(1.0), {}, None, {}).finite is None  # no loss scaling: no verdict


def test_an_overflowing_step_leaves_the_state_and_statistics_as_they_were():
    old = _State({"w": jnp.ones(2)}, {"mean": jnp.zeros(2)})
    new = _State({"w": jnp.full(2, 5.0)}, {"mean": jnp.full(2, 9.0)})
    kept, stats = body.skip_unless_finite(jnp.bool_(False), new, new.model_state, old)
    np.testing.assert_array_equal(kept.params["w"], old.params["w"])
    np.testing.assert_array_equal(stats["mean"], old.model_state["mean"])
    applied, stats = body.skip_unless_finite(jnp.bool_(True), new, new.model_state, old)
    np.testing.assert_array_equal(applied.params["w"], new.params["w"])
    np.testing.assert_array_equal(stats["mean"], new.model_state["mean"])


def test_finish_adds_the_averages_traffic_to_the_updates_and_takes_the_verdict_out():
    """The records' comm fields are the update's plus the averages' (counts stay int32); the reduction's
    finiteness verdict is no record; loss scaling without a verdict is refused."""
    import flax
    import pytest

    from dtx.comm.context import count_scalar
    from dtx.precision import LossScaler

    @flax.struct.dataclass
    class Stepped:
        step: Any
        params: Any
        model_state: Any
        rng: Any

    old = Stepped(jnp.int32(3), {"w": jnp.ones(2)}, {}, jnp.zeros(2, jnp.uint32))
    new = old.replace(params={"w": jnp.zeros(2)})
    worked = body.Pass(grads=None, loss=jnp.float32(1.0), values={"accuracy": jnp.float32(0.5)}, finite=None,
                       model_state={}, rng=jnp.ones(2, jnp.uint32),
                       traffic={"comm_bytes": count_scalar(56), "comm_rounds": count_scalar(14),
                                "comm_bytes_logging": count_scalar(56), "comm_rounds_logging": count_scalar(14)})
    stats = {"comm_bytes": count_scalar(1000), "comm_rounds": count_scalar(14), "grads_finite": jnp.bool_(True)}
    sync, local = strategies.sync(), strategies.local_sgd()
    state, metrics = body.finish(old, new, dict(stats), worked, LossScaler(), sync)
    assert list(metrics) == ["loss", "accuracy", "comm_bytes", "comm_rounds", "comm_bytes_logging",
                             "comm_rounds_logging"]
    assert (int(metrics["comm_bytes"]), int(metrics["comm_rounds"])) == (1056, 28)
    assert {np.asarray(metrics[k]).dtype for k in list(metrics)[2:]} == {np.dtype(np.int32)}
    assert int(state.step) == 4 and np.array_equal(state.rng, worked.rng) and float(state.params["w"][0]) == 0.0
    with pytest.raises(body.BodyError, match="loss scaling needs strategy 'local_sgd'"):
        body.finish(old, new, {"comm_bytes": 0, "comm_rounds": 0}, worked, LossScaler(enabled=True), local)


def test_only_workers_with_their_own_models_have_averages_a_step_may_leave_out():
    """records_collective: local SGD, DiLoCo, EASGD, gossip and Streaming DiLoCo average for the records only
    (a record=False step drops it); sync and every strategy that reduces gradients keep it every step."""
    local = {name for name, factory in strategies.STRATEGIES.items() if body.records_collective(factory())}
    assert local == {"local_sgd", "diloco", "easgd", "gossip", "streaming_diloco"}


def test_finish_without_averages_reports_no_loss_and_keeps_each_workers_statistics():
    """A step built without records (its Pass has no loss): no loss nor metrics, the update's traffic alone,
    and a local-model worker's batch-norm statistics go to its own slice, not the replicated model_state."""
    import flax

    from dtx.comm.context import count_scalar
    from dtx.precision import LossScaler

    @flax.struct.dataclass
    class Stepped:
        step: Any
        params: Any
        model_state: Any
        rng: Any
        worker: Any

    old = Stepped(jnp.int32(0), {"w": jnp.ones(2)}, {}, jnp.zeros(2, jnp.uint32), {"model_state": {"m": jnp.zeros(2)}})
    worked = body.Pass(grads=None, loss=None, values={}, finite=None, model_state={"m": jnp.full(2, 3.0)},
                       rng=jnp.ones(2, jnp.uint32),
                       traffic={"comm_bytes": count_scalar(0), "comm_rounds": count_scalar(0),
                                "comm_bytes_logging": count_scalar(0), "comm_rounds_logging": count_scalar(0)})
    stats = {"comm_bytes": count_scalar(9680), "comm_rounds": count_scalar(2)}
    state, metrics = body.finish(old, old, dict(stats), worked, LossScaler(), strategies.gossip())
    assert "loss" not in metrics and (int(metrics["comm_bytes"]), int(metrics["comm_rounds"])) == (9680, 2)
    assert state.model_state == {} and float(state.worker["model_state"]["m"][0]) == 3.0
    assert body.model_state_of(state, strategies.gossip()) is state.worker["model_state"]
