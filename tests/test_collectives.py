"""Allreduce algorithms == lax.psum; bucketing; traffic counts == the cost model; in training,
replicas bit-identical and the records equal to what the compiled step sends.

Each algorithm must equal ``lax.psum`` for every p in 1..8 (DESIGN.md §6): exactly on
integers, and on floats within ``FLOAT_RTOL`` (a different summation order is the
only difference). Replicated state must be bit-identical on every device after every
training step: no tolerance (nothing re-synchronises replicas). Each program combines
many sizes in one pytree so the file compiles few programs, and every result is waited
on before the next call (DESIGN.md §2).
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from dtx.comm import collectives, costmodel
from dtx.comm.algorithms import ALGORITHMS, CollectiveError
from dtx.comm.collectives import count_traffic, make_allreduce
from dtx.comm.costmodel import Traffic
from dtx.mesh import make_mesh

FLAT = tuple(a for a in ALGORITHMS if a != "hierarchical")
FLOAT_RTOL = 1e-5  # float32 sums of 8 values of magnitude <= 1 in different orders
FLOAT_ATOL = 1e-6
SHAPES = [(), (1,), (5,), (7, 3), (1000,)]  # scalars, sizes below p, not divisible by p, large


def _mesh(spec):
    devices = jax.devices()[: math.prod(size for _, size in spec)]
    return make_mesh(spec, devices=devices)


def _per_device(fn, mesh, axes, tree, **kwargs):
    """Run fn on per-device slices; return every device's output (leading axis = device)."""

    def body(t):
        out = fn(jax.tree.map(lambda v: v[0], t))
        return jax.tree.map(lambda v: jnp.asarray(v)[None], out)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), **kwargs)
    return jax.tree.map(np.asarray, jax.jit(mapped)(tree))  # np.asarray waits for the result


def _tree(p, seed, dtype):
    """One leaf per shape in SHAPES, per-device values on a leading axis of size p (numpy: no compiles)."""
    rng = np.random.default_rng(seed)
    if np.issubdtype(dtype, np.integer):
        return [rng.integers(-1000, 1000, (p, *s)).astype(dtype) for s in SHAPES]
    return [rng.uniform(-1.0, 1.0, (p, *s)).astype(dtype) for s in SHAPES]


def _assert_all_devices_equal(per_device, reference, *, exact):
    for got, want in zip(jax.tree.leaves(per_device), jax.tree.leaves(reference)):
        # Every device holds the very same bits (what lets out_specs=P() with check_vma=False work).
        np.testing.assert_array_equal(got, np.broadcast_to(got[:1], got.shape))
        assert got.dtype == want.dtype and got.shape == want.shape
        if exact:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got, want, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


@pytest.mark.parametrize("p", range(1, 9))
def test_flat_algorithms_equal_psum(p):
    mesh = _mesh([("data", p)])
    ints, floats = _tree(p, p, np.int32), _tree(p, 100 + p, np.float32)[-2:]  # floats: (7, 3), (1000,)

    def fn(t):
        ints, floats = t
        out = {"ref": (lax.psum(ints, "data"), lax.pmean(floats, "data"))}
        for name in FLAT:
            out[name] = (make_allreduce(name, ("data",), mean=False)(ints),
                         make_allreduce(name, ("data",), mean=True)(floats))
        return out

    out = _per_device(fn, mesh, "data", (ints, floats))
    ref_ints, ref_floats = out.pop("ref")
    for name, (got_ints, got_floats) in out.items():
        _assert_all_devices_equal(got_ints, ref_ints, exact=True)
        _assert_all_devices_equal(got_floats, ref_floats, exact=False)


@pytest.mark.parametrize("outer,inner", [(1, 1), (1, 4), (2, 2), (2, 3), (2, 4), (4, 2), (3, 2)])
def test_hierarchical_equals_psum(outer, inner):
    axes = ("node", "local")
    mesh = _mesh([("node", outer), ("local", inner)])
    p = outer * inner
    ints, floats = _tree(p, p, np.int32), _tree(p, 7, np.float32)[-1]

    def fn(t):
        ints, floats = t
        got = (make_allreduce("hierarchical", axes, mean=False)(ints),
               make_allreduce("hierarchical", axes, mean=True)(floats))
        return got, (lax.psum(ints, axes), lax.pmean(floats, axes))

    (got_ints, got_floats), (ref_ints, ref_floats) = _per_device(fn, mesh, axes, (ints, floats))
    _assert_all_devices_equal(got_ints, ref_ints, exact=True)
    _assert_all_devices_equal(got_floats, ref_floats, exact=False)


def test_mixed_dtypes_bucketing_and_two_axes_equal_psum():
    # Flat algorithms over two axes treat them as one ring of 6 ranks (ppermute with a
    # tuple of axis names); hierarchical uses them as (outer, inner).
    axes = ("node", "local")
    mesh = _mesh([("node", 2), ("local", 3)])
    rng = np.random.default_rng(0)
    small_ints = lambda shape, dtype: rng.integers(-4, 5, (6, *shape)).astype(dtype)  # noqa: E731
    tree = {  # integer-valued floats: every summation order is exact, so results must be bit-equal
        "w": small_ints((7, 3), np.float32),
        "b": small_ints((5,), jnp.bfloat16),
        "count": small_ints((), np.int32),
        "big": small_ints((1000,), np.float32),
        "h": small_ints((33,), jnp.bfloat16),
        "i": small_ints((4,), np.int32),
    }
    bucket_sizes = (0, 1, 20, 4096)  # 1 byte: one leaf per bucket; 4 KiB: here one bucket per dtype

    def fn(t):
        out = {"ref": lax.pmean({k: v for k, v in t.items() if v.dtype != jnp.int32}, axes)}
        out["ref"].update({k: lax.psum(v, axes) // 6 for k, v in t.items() if v.dtype == jnp.int32})
        for name in ALGORITHMS:
            for size in bucket_sizes:
                out[f"{name}/{size}"] = make_allreduce(name, axes, mean=True, bucket_bytes=size)(t)
        return out

    out = _per_device(fn, mesh, axes, tree)
    ref = out.pop("ref")
    assert set(out) == {f"{name}/{size}" for name in ALGORITHMS for size in bucket_sizes}
    for got in out.values():
        assert got.keys() == ref.keys()
        _assert_all_devices_equal([got[k] for k in ref], [ref[k] for k in ref], exact=True)


def test_empty_leaves_pass_through():
    # Traced only: XLA:CPU in jax 0.11.2 segfaults compiling some multi-device programs
    # that carry zero-size arrays (even a plain lax.pmean of one), so none are compiled here.
    mesh = _mesh([("node", 2), ("local", 3)])
    axes = ("node", "local")
    tree = {"empty": jax.ShapeDtypeStruct((6, 0), jnp.float32), "x": jax.ShapeDtypeStruct((6, 3), jnp.bfloat16)}
    for name in ALGORITHMS:
        for size in (0, 8):
            reduce = make_allreduce(name, axes, bucket_bytes=size)
            mapped = jax.shard_map(reduce, mesh=mesh, in_specs=P(axes), out_specs=P(axes))
            out = jax.eval_shape(mapped, tree)
            assert {k: (v.shape, v.dtype) for k, v in out.items()} == {k: (v.shape, v.dtype) for k, v in tree.items()}


def test_plan_buckets():
    leaves = [jax.ShapeDtypeStruct(s, d) for s, d in [
        ((10,), jnp.float32), ((3,), jnp.bfloat16), ((100,), jnp.float32), ((0,), jnp.float32),
        ((2,), jnp.float32), ((4,), jnp.bfloat16), ((5,), jnp.int32)]]
    assert costmodel.plan_buckets(leaves, 1) == [(0,), (1,), (2,), (4,), (5,), (6,)]  # tiny: one leaf each
    assert costmodel.plan_buckets(leaves, 1 << 20) == [(0, 2, 4), (1, 5), (6,)]  # one per dtype
    # 48-byte cap: the 400-byte leaf travels alone; the 8 bytes after it open a new bucket.
    assert costmodel.plan_buckets(leaves, 48) == [(0,), (1, 5), (2,), (4,), (6,)]
    for cap in (1, 16, 48, 1 << 20):
        buckets = costmodel.plan_buckets(leaves, cap)
        assert sorted(i for b in buckets for i in b) == [0, 1, 2, 4, 5, 6]  # empty leaf 3 in none
        for bucket in buckets:
            assert len({leaves[i].dtype for i in bucket}) == 1
            nbytes = sum(leaves[i].size * leaves[i].dtype.itemsize for i in bucket)
            assert nbytes <= cap or len(bucket) == 1


def test_integer_mean_floors_and_keeps_dtype():
    mesh = _mesh([("data", 3)])
    x = np.array([[1, -7], [1, 0], [1, 0]], np.int32)
    out = _per_device(lambda v: make_allreduce("ring", ("data",))(v), mesh, "data", x)
    np.testing.assert_array_equal(out, [[1, -3]] * 3)  # 3 // 3 and -7 // 3 (floor)
    assert out.dtype == np.int32


def test_errors_are_clear():
    with pytest.raises(CollectiveError, match=r"'bogus'.*psum, ring, halving_doubling"):
        make_allreduce("bogus", ("data",))
    for axes in (("data",), ("a", "b", "c")):
        with pytest.raises(CollectiveError, match=r"two batch axes like \[\('node', 2\), \('local', 4\)\]"):
            make_allreduce("hierarchical", axes)
    with pytest.raises(CollectiveError, match="bucket_bytes"):
        make_allreduce("ring", ("data",), bucket_bytes=-1)
    with pytest.raises(CollectiveError, match="distinct"):
        make_allreduce("ring", ("data", "data"))
    with pytest.raises(CollectiveError, match="'bogus'"):
        costmodel.predict_time("bogus", 1024, 8, 1e-6, 1e-9)
    with pytest.raises(CollectiveError, match="inner"):
        costmodel.predict_time("hierarchical", 1024, 8, 1e-6, 1e-9)  # inner missing
    with pytest.raises(CollectiveError, match="inner"):
        count_traffic("hierarchical", 1024, 8, inner=3)  # 3 does not divide 8


TRAFFIC_SIZES = [1, 6, 1000, jax.ShapeDtypeStruct((7, 3), jnp.float32), jax.ShapeDtypeStruct((5,), jnp.bfloat16)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_traffic_counted_from_schedule_equals_formula(algorithm):
    for p in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16):
        inners = [s for s in (1, 2, 3, 4) if p % s == 0] if algorithm == "hierarchical" else [None]
        for size in TRAFFIC_SIZES:
            itemsize = 1 if isinstance(size, int) else size.dtype.itemsize
            nbytes = size if isinstance(size, int) else size.size * itemsize
            for inner in inners:
                counted = count_traffic(algorithm, size, p, inner)
                assert counted == costmodel.expected_traffic(algorithm, nbytes, p, inner, itemsize), (p, size, inner)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_counts_match_smooth_model_when_sizes_divide(algorithm):
    # For p a power of two and n divisible by p there is no padding and no folding:
    # messages sent == α rounds and bytes sent == β bytes of Thakur's formulas, except
    # the tree, whose busiest device sends in only half of the 2⌈lg p⌉ rounds.
    for p, inner in ((2, 2), (4, 2), (8, 4), (16, 4), (64, 8)):
        nbytes = 64 * p
        terms = costmodel.cost_terms(algorithm, nbytes, p, inner)
        counted = count_traffic(algorithm, nbytes, p, inner if algorithm == "hierarchical" else None)
        share = 2 if algorithm == "tree" else 1
        assert counted == Traffic(terms.rounds // share, terms.path_bytes // share)


def _sgd_step(reduce, check_vma, invariant=False):
    """A data-parallel SGD step in the shape of dtx.step's shard_map driver."""
    mesh = _mesh([("data", 8)])

    def loss(w, x):
        return jnp.mean((x @ w["k"] + w["b"]) ** 2)

    def body(w, x):
        grads = jax.grad(loss)(lax.pcast(w, ("data",), to="varying"), x)
        grads = reduce(grads)
        if invariant:
            grads = collectives.as_invariant(grads, ("data",))
        return jax.tree.map(lambda p, g: p - 0.1 * g, w, grads)

    step = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("data")), out_specs=P(), check_vma=check_vma))
    w = {"k": np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3), "b": np.zeros(3, np.float32)}
    x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
    return jax.tree.map(np.asarray, step(w, x))


def test_custom_allreduce_in_a_train_step():
    reference = _sgd_step(functools.partial(lax.pmean, axis_name=("data",)), check_vma=True)
    ring = make_allreduce("ring", ("data",))
    # The finding for callers: a ppermute-built mean is typed varying, so out_specs=P()
    # needs check_vma=False (free) or as_invariant (an all-gather), never neither.
    with pytest.raises(ValueError, match="out_specs"):
        _sgd_step(ring, check_vma=True)
    for got in (_sgd_step(ring, check_vma=False), _sgd_step(ring, check_vma=True, invariant=True),
                _sgd_step(make_allreduce("psum", ("data",)), check_vma=True, invariant=True)):
        for g, r in zip(jax.tree.leaves(got), jax.tree.leaves(reference)):
            np.testing.assert_allclose(g, r, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


# ------------------------------------------------------------------ training with each algorithm
REPLICA_STEPS = 20  # replicated state must stay bit-identical on every device, step after step
COMPARE_STEPS = 5  # against psum: within FLOAT_RTOL after this many steps
TRAINING = [("psum", 0), ("ring", 0), ("halving_doubling", 0), ("recursive_doubling", 0), ("tree", 0),
            ("hierarchical", 0), ("psum", 4096), ("ring", 4096), ("hierarchical", 4096)]


@functools.lru_cache(maxsize=None)
def _setup(mesh_spec):
    """Mesh, model, optimizer, loader and the initial state (a host copy and its shardings) of ``mesh_spec``:
    built once per mesh, as every run on it starts from the same state and reads the same batches."""
    import optax

    from dtx import models
    from dtx.data import datasets
    from dtx.data import TrainLoader
    from dtx.step.state import init_train_state

    mesh = make_mesh(list(mesh_spec))
    model = models.build_model("mlp", features=(32,))
    tx = optax.sgd(0.1, momentum=0.9)
    state = init_train_state(model, tx, jax.ShapeDtypeStruct((1, 8, 8, 1), np.float32), 0, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, state)
    loader = TrainLoader(datasets.load_dataset("digits").train, 64, mesh, seed=0)
    return mesh, model, tx, jax.device_get(state), shardings, loader


def _parts(mesh_spec):
    """A fresh initial state (the steps donate it), placed as ``init_train_state`` placed it: no program run."""
    mesh, model, tx, host_state, shardings, loader = _setup(tuple(mesh_spec))
    return mesh, model, tx, jax.device_put(host_state, shardings), loader


def _mesh_of(algorithm):
    return [("node", 2), ("local", 4)] if algorithm == "hierarchical" else [("data", 8)]


class _Run:
    """One training run: its step compiled once (what test_bucketed_step_records_what_its_program_sends
    reads), then stepped on demand; the first step's metrics, the parameters after ``COMPARE_STEPS``, and
    the first step (if any) after which some replicated leaf (parameters, momentum) differs between devices."""

    def __init__(self, allreduce, mesh_spec, bucket_bytes):
        from dtx.step import StepSpec, make_train_step

        mesh, model, tx, self.state, self.loader = _parts(mesh_spec)
        step = make_train_step(model, tx, mesh, StepSpec(allreduce=allreduce, bucket_bytes=bucket_bytes))
        self.compiled = step.lower(self.state, self.loader.batch(0)).compile()
        self.steps, self.first_metrics, self.compared, self.drift = 0, None, None, None

    def advance(self, steps):
        while self.steps < steps:
            s = self.steps
            self.state, metrics = self.compiled(self.state, self.loader.batch(s))
            jax.block_until_ready(metrics)
            if s == 0:
                self.first_metrics = jax.device_get(metrics)
            for leaf in jax.tree.leaves((self.state.params, self.state.opt_state)):
                shards = [np.asarray(shard.data) for shard in leaf.addressable_shards]
                if self.drift is None and not all(np.array_equal(shards[0], other) for other in shards[1:]):
                    self.drift = s
            if s + 1 == COMPARE_STEPS:
                self.compared = jax.device_get(self.state.params)
            self.steps += 1
        return self


@pytest.fixture(scope="module")
def training():
    """Every case of TRAINING (and of the bucketed records), compiled once for the module and stepped as far
    as the tests ask (cached as they ask for them)."""
    runs = {}

    def get(algorithm, bucket_bytes, mesh_spec=None, steps=REPLICA_STEPS):
        mesh_spec = mesh_spec or _mesh_of(algorithm)
        key = (algorithm, bucket_bytes, tuple(mesh_spec))
        if key not in runs:
            runs[key] = _Run(algorithm, mesh_spec, bucket_bytes)
        return runs[key].advance(steps)

    return get


@pytest.mark.parametrize("algorithm,bucket_bytes", TRAINING)
def test_replicas_stay_bit_identical(training, algorithm, bucket_bytes):
    # Nothing re-synchronises replicated parameters: one ulp of difference would persist and grow.
    drift = training(algorithm, bucket_bytes).drift
    assert drift is None, f"{algorithm} (bucket_bytes={bucket_bytes}): replicas differ after step {drift}"


@pytest.mark.parametrize("algorithm,bucket_bytes", [case for case in TRAINING if case != ("psum", 0)])
def test_training_with_each_algorithm_equals_psum(training, algorithm, bucket_bytes):
    params = training(algorithm, bucket_bytes).compared
    reference = training("psum", 0, _mesh_of(algorithm)).compared
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(reference)):
        np.testing.assert_allclose(got, want, rtol=FLOAT_RTOL, atol=FLOAT_ATOL)


# ------------------------------------------------------------------ bucketing in the compiled program
@pytest.mark.parametrize("algorithm,bucket_bytes", [("ring", 1 << 20), ("ring", 4096), ("halving_doubling", 4096),
                                                    ("recursive_doubling", 4096), ("hierarchical", 4096),
                                                    ("tree", 4096), ("psum", 4096)])
def test_bucketed_step_records_what_its_program_sends(training, algorithm, bucket_bytes):
    """The record's ``comm_bytes`` / ``comm_rounds`` against the compiled step (dtx.comm.hlo): one allreduce per
    bucket. MLP 64-32-10: leaves of 128, 8192, 40 and 1280 bytes; 1 MiB holds them all (one bucket),
    4 KiB makes three: [b0], [k0] (larger than a bucket: alone), [b1, k1]. (The compiled steps of TRAINING's
    bucketed runs, and their first step's record.)"""
    from dtx.comm import hlo

    run = training(algorithm, bucket_bytes, steps=1)
    buckets = costmodel.plan_buckets(jax.tree.leaves(run.state.params), bucket_bytes)
    assert len(buckets) == (1 if bucket_bytes > 8192 else 3)
    compiled, metrics = run.compiled, run.first_metrics
    record = int(metrics["comm_bytes"]), int(metrics["comm_rounds"])
    found = hlo.collectives(compiled)
    total = lambda ops: (sum(c.bytes_sent for c in ops), sum(c.rounds for c in ops))  # noqa: E731
    reduces = [c for c in found if c.kind == "all-reduce"]
    permutes = [c for c in found if c.kind == "collective-permute"]
    assert len(reduces) + len(permutes) == len(found)
    if algorithm == "psum":  # XLA's combiner merges the buckets' psums (and may merge the metrics'): the ring's
        assert not permutes and total(found)[0] == record[0]  # bytes of each bucket; its rounds are XLA's
        assert all(c.rounds == 2 * 7 for c in reduces)
        return
    assert [c.operand_bytes for c in reduces] == [8]  # the loss and accuracy, counted in the record too
    if algorithm == "tree":
        # The reader sums each ppermute's busiest sender (a tree's senders change with the level: 2⌈lg p⌉
        # ppermutes per bucket), the accountant the busiest device over the schedule: exactly twice.
        reduced = [r - m for r, m in zip(record, total(reduces))]
        assert len(permutes) == 2 * 3 * len(buckets) and total(permutes) == (2 * reduced[0], 2 * reduced[1])
    else:
        assert total(found) == record
    if algorithm == "ring":
        assert len(permutes) == 2 * 7 * len(buckets)  # 14 per bucket, not 14 per leaf
