"""The shard_map step's accountant (``comm_bytes``/``comm_rounds``) against the compiled program (dtx.hlo).

One table of cases: every allreduce algorithm with and without bucketing, every
compressor, every strategy, on a tiny MLP (64 → 16 → 10: gradient leaves of 16, 1024,
10 and 160 float32 entries) over 8 workers. For each case the step is compiled once,
read by :mod:`dtx.hlo`, and run for the one to three steps the comparison needs.

Where the two agree they must agree exactly, bytes and rounds, once one difference common
to every case is added (:data:`METRICS`): every step averages its loss and accuracy for the
records, an all-reduce the accountant leaves out. Where they disagree otherwise,
:data:`KNOWN_DIFFERENCES` names the case and the reason, and :data:`PREDICT` states the
exact relation that reason implies: the test fails if the difference grows, shrinks or
disappears. Collectives in a ``lax.cond``/``lax.switch`` branch are listed by the reader
whether or not the branch runs; they are compared with the accountant on the steps that
run them.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import models
from dtx import collectives, compress, costmodel, hlo, optim, strategies
from dtx import mesh as mesh_lib
from dtx.state import init_train_state
from dtx.step import make_train_step

P = 8
RING = 2 * (P - 1)  # rounds of one ring all-reduce
BUCKET = 1024  # bytes: the leaves (64, 4096, 40, 640 bytes) fall into buckets [b0], [k0], [b1, k1]
FLAT = [("data", P)]
TWO_LEVEL = [("node", 2), ("local", 4)]


def ring_bytes(sizes, itemsize=4):
    """Bytes one device sends in ring all-reduces of float32 arrays of these sizes (one per array)."""
    return sum(costmodel.expected_traffic("ring", n * itemsize, P, itemsize=itemsize).bytes_sent for n in sizes)


METRICS_BYTES = ring_bytes([1, 1])  # loss and accuracy: 2 × 2·7·⌈1/8⌉·4 = 112
METRICS = ("every step pmeans its loss and accuracy (two float32 scalars) for the records: one all-reduce, "
           f"{METRICS_BYTES} bytes and 2(p−1) rounds (none where XLA merges it into a gradient all-reduce), "
           "that the accountant leaves out: it counts the training traffic")

CASES = {}
for _algorithm in collectives.ALGORITHMS:
    _mesh = TWO_LEVEL if _algorithm == "hierarchical" else FLAT
    CASES[_algorithm] = dict(allreduce=_algorithm, mesh=_mesh)
    CASES[_algorithm + "+bucket"] = dict(allreduce=_algorithm, bucket=BUCKET, mesh=_mesh)
for _name in compress.COMPRESSORS:
    if _name != "none":  # none is the algorithm cases
        CASES["compress:" + _name] = dict(compressor=_name)
for _name, _settings, _steps in [("async", dict(staleness=2), 1), ("ssp", dict(staleness=2), 1),
                                 ("local_sgd", dict(period=2), 2), ("diloco", dict(period=2), 2),
                                 ("easgd", dict(period=2), 2), ("gossip", {}, 1),
                                 ("gossip_exponential", dict(topology="exponential"), 3)]:
    CASES["strategy:" + _name] = dict(strategy=_name.split("_exp")[0], settings=_settings, steps=_steps)
# The averaging in a branch with dtx's own ring: no combiner, so the two agree exactly.
CASES["strategy:local_sgd+ring"] = dict(strategy="local_sgd", settings=dict(period=2), steps=2, allreduce="ring")
assert {c["strategy"] for c in CASES.values() if "strategy" in c} | {"sync"} == set(strategies.STRATEGIES)


@dataclasses.dataclass
class Run:
    algorithm: str  # the configured allreduce
    accountant: list  # [(comm_bytes, comm_rounds)] per step run, as the metrics report them
    found: list  # dtx.hlo.collectives of the compiled step
    leaves: list  # sizes of the gradient leaves, in tree order
    inner: int | None  # hierarchical's inner-axis size

    @property
    def compiled(self):
        return sum(c.bytes_sent for c in self.found), sum(c.rounds for c in self.found)


@pytest.fixture(scope="module")
def parts():
    model = models.build_model("mlp", features=(16,), num_classes=10)
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.normal(size=(64, 8, 8, 1)).astype(np.float32),
             "labels": rng.integers(0, 10, 64).astype(np.int32)}
    return model, optim.make_optimizer("sgd", 0.1), batch, {}


def run(parts, name) -> Run:
    """Compile case ``name`` once, read it, run its steps (cached for the module)."""
    model, tx, host_batch, cache = parts
    if name not in cache:
        case = CASES[name]
        mesh = mesh_lib.make_mesh(case.get("mesh", FLAT))
        compressor = compress.make_compressor(case.get("compressor", "none"))
        strategy = strategies.make_strategy(case.get("strategy", "sync"), **case.get("settings", {}))
        example = jax.ShapeDtypeStruct(host_batch["inputs"].shape, jnp.float32)
        state = init_train_state(model, tx, example, 0, mesh, strategy=strategy, compressor=compressor)
        algorithm = case.get("allreduce", "psum")
        step = make_train_step(model, tx, mesh, allreduce=algorithm, bucket_bytes=case.get("bucket", 0),
                               compressor=compressor, strategy=strategy)
        batch = jax.device_put(host_batch, mesh_lib.batch_sharding(mesh))
        compiled = step.lower(state, batch).compile()
        accountant = []
        for _ in range(case.get("steps", 1)):
            state, metrics = compiled(state, batch)
            accountant.append((float(metrics["comm_bytes"]), float(metrics["comm_rounds"])))
        cache[name] = Run(algorithm, accountant, hlo.collectives(compiled),
                          [x.size for x in jax.tree.leaves(state.params)],
                          mesh.shape["local"] if algorithm == "hierarchical" else None)
    return cache[name]


# ----------------------------------------------------------------------------- the relations
def traffic(algorithm, sizes, inner=None):
    """Allreduces of float32 arrays of these sizes, one after another, in the cost model."""
    algorithm = "ring" if algorithm == "psum" else algorithm
    return costmodel.add_traffic(*(costmodel.expected_traffic(algorithm, 4 * n, P, inner, 4) for n in sizes))


def buckets(leaves):
    """Sizes of the buckets the step packs the leaves into (dtx.collectives.plan_buckets)."""
    spec = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in leaves]
    return [sum(leaves[i] for i in bucket) for bucket in collectives.plan_buckets(spec, BUCKET)]


def agree(r):
    """The accountant's figures (of the last step run) plus the metrics pmean, its own op."""
    nbytes, rounds = r.accountant[-1]
    return nbytes + METRICS_BYTES, rounds + RING


def combined(ops):
    """XLA's all-reduce combiner: the accountant's bytes (of the last step run), but 2(p−1) rounds per op."""
    return lambda r: (r.accountant[-1][0] + METRICS_BYTES, ops * RING)


def bucketed(factor=1, ops=None):
    """One allreduce per bucket, where the accountant counts leaf by leaf; ``ops``: combined by XLA."""

    def predict(r):
        leaf_by_leaf = traffic(r.algorithm, r.leaves, r.inner)
        assert r.accountant == [(leaf_by_leaf.bytes_sent, leaf_by_leaf.messages)]
        per_bucket = traffic(r.algorithm, buckets(r.leaves), r.inner)
        rounds = ops * RING if ops else factor * per_bucket.messages + RING
        return factor * per_bucket.bytes_sent + METRICS_BYTES, rounds

    return predict


def tree(r):
    # p = 8: ⌈lg p⌉ = 3 reduce and 3 broadcast ppermutes per leaf; rank 0 sends in the 3 broadcast ones.
    assert sum(c.kind == "collective-permute" for c in r.found) == 2 * 3 * len(r.leaves)
    (nbytes, rounds), = r.accountant
    return 2 * nbytes + METRICS_BYTES, 2 * rounds + RING


def cast(r):
    (nbytes, _), = r.accountant
    return 2 * nbytes + METRICS_BYTES, 1 * RING


def ssp(r):
    # Step 0 of ssp(staleness=2): ages (0 + ⌊3i/8⌋) mod 3 = 0,0,0,1,1,1,2,2, so f = 3/8 of the workers pull.
    dense = traffic("ring", r.leaves)
    assert r.accountant == [(dense.bytes_sent * (1 + 3 / 8) / 2, dense.messages * (1 + 3 / 8) / 2)]
    return dense.bytes_sent + METRICS_BYTES, 1 * RING


def gossip(r):
    """Every step's mixing the reader lists (one, or every branch of the switch), plus the extra pmean."""
    sent, rounds = (sum(x) for x in zip(*r.accountant))
    consensus = ring_bytes(r.leaves) + ring_bytes([1])  # the parameters' pmean and the distance's, one op
    return sent + METRICS_BYTES + consensus, rounds + RING + RING


KNOWN_DIFFERENCES = {
    "psum": "XLA's all-reduce combiner merges the per-leaf psums and the metrics pmean into one tuple "
            "all-reduce: one 2(p−1)-round schedule, where the accountant counts 2(p−1) rounds per leaf",
    "psum+bucket": "XLA's combiner merges the bucket psums into one all-reduce (with the metrics): the ring "
                   "bytes of the buckets, 2(p−1) rounds once; the accountant counts leaf by leaf",
    "ring+bucket": "bucketing: the accountant counts the allreduce leaf by leaf (dense_allreduce_traffic ignores "
                   "bucket_bytes); the step reduces bucket by bucket, 3 buckets for 4 leaves",
    "halving_doubling+bucket": "bucketing: the accountant counts leaf by leaf, the step reduces bucket by bucket",
    "recursive_doubling+bucket": "bucketing: the accountant counts leaf by leaf, the step reduces bucket by bucket",
    "hierarchical+bucket": "bucketing: the accountant counts leaf by leaf, the step reduces bucket by bucket",
    "tree": "the reader sums each ppermute's busiest sender, and the tree's senders change from level to level "
            "(2⌈lg p⌉ ppermutes per leaf), while the accountant takes the busiest device over the whole schedule "
            "(rank 0: the ⌈lg p⌉ broadcast sends): exactly twice the bytes and rounds",
    "tree+bucket": "the tree's factor 2 (see tree) on one allreduce per bucket; the accountant counts leaf by leaf",
    "compress:cast": "XLA's CPU backend runs the bfloat16 all-reduce in float32 (the HLO converts the operands to "
                     "f32 first): twice the accountant's bfloat16 bytes; the psums are also combined into one op",
    "compress:randomk": "XLA combines the values' psum and the metrics pmean into one all-reduce (rounds 2(p−1) once)",
    "compress:powersgd": "XLA combines PowerSGD's two per-leaf psums (P with the vectors, then Q) and the metrics "
                         "pmean into 3 all-reduce ops by data dependence; the accountant counts 2(p−1) rounds per leaf",
    "strategy:async": "the gradient psums and the metrics pmean combined into one all-reduce (as psum)",
    "strategy:ssp": "the accountant models a sharded parameter server that pulls only for expired caches, "
                    "(1 + f)/2 of the allreduce with f = 3/8 at step 0; the emulation runs the whole allreduce every "
                    "step (combined into one op with the metrics, as psum)",
    "strategy:local_sgd": "the averaging psums sit in a lax.cond branch (listed although step 0 sends nothing) and "
                          "are combined into one op; compared with step 1, which averages",
    "strategy:diloco": "the outer step's psums of the deltas, in a lax.cond branch, combined into one op; compared "
                       "with step 1",
    "strategy:easgd": "the elastic exchange's psums, in a lax.cond branch, combined into one op; compared with step 1",
    "strategy:gossip": "an extra all-reduce of every parameter per step (lax.pmean: the workers' mean becomes "
                       "state.params), combined with the consensus distance's pmean, not counted by the accountant",
    "strategy:gossip_exponential": "the extra all-reduce of gossip, and the reader lists every branch of the "
                                   "lax.switch over the ⌈lg p⌉ = 3 mixing rounds: the sum of steps 0-2's figures",
}
PREDICT = {
    "psum": combined(1), "psum+bucket": bucketed(ops=1),
    **{a + "+bucket": bucketed() for a in ("ring", "halving_doubling", "recursive_doubling", "hierarchical")},
    "tree": tree, "tree+bucket": bucketed(factor=2),
    "compress:cast": cast, "compress:randomk": combined(1), "compress:powersgd": combined(3),
    "strategy:async": combined(1), "strategy:ssp": ssp,
    # local models: the metrics pmean, and the combined average in the branch; step 1 averages.
    "strategy:local_sgd": combined(2), "strategy:diloco": combined(2), "strategy:easgd": combined(2),
    "strategy:gossip": gossip, "strategy:gossip_exponential": gossip,
}


def test_every_known_difference_has_its_relation():
    assert set(KNOWN_DIFFERENCES) == set(PREDICT) and set(PREDICT) <= set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_accountant_against_compiled(parts, name):
    r = run(parts, name)
    predicted = PREDICT.get(name, agree)(r)
    assert r.compiled == predicted, (KNOWN_DIFFERENCES.get(name, "should agree"), METRICS, r.accountant, r.compiled)


def test_the_metrics_pmean_is_one_small_all_reduce(parts):
    # Where the gradients travel by ppermute, the only all-reduce is the metrics': two float32 scalars.
    for name in ("ring", "halving_doubling", "recursive_doubling", "tree", "hierarchical"):
        reduces = [c for c in run(parts, name).found if c.kind == "all-reduce"]
        assert [(c.operand_bytes, c.bytes_sent, c.rounds) for c in reduces] == [(8, METRICS_BYTES, RING)], name


def test_psum_is_one_combined_all_reduce(parts):
    r = run(parts, "psum")
    (op,) = r.found
    assert (op.kind, op.operand_bytes, op.context) == ("all-reduce", 4 * sum(r.leaves) + 8, "entry")


def test_cast_travels_as_float32_on_this_backend(parts):
    r = run(parts, "compress:cast")
    (op,) = r.found
    assert op.operand_bytes == 4 * sum(r.leaves) + 8  # not 2 bytes per entry: f32 on the wire


@pytest.mark.parametrize("name", ["strategy:local_sgd", "strategy:diloco", "strategy:easgd"])
def test_averaging_runs_in_a_branch_on_some_steps(parts, name):
    r = run(parts, name)
    assert r.accountant[0] == (0.0, 0.0) and r.accountant[1][0] > 0  # period 2: step 1 averages
    contexts = sorted((c.context, c.operand_bytes) for c in r.found)
    assert contexts == [("conditional", 4 * sum(r.leaves)), ("entry", 8)]


def test_ring_averaging_in_a_branch(parts):
    r = run(parts, "strategy:local_sgd+ring")
    assert r.accountant[0] == (0.0, 0.0)
    permutes = [c for c in r.found if c.kind == "collective-permute"]
    assert len(permutes) == 4 * RING and {c.context for c in permutes} == {"conditional"}  # 4 leaves × 2(p−1)


def test_gossip_exponential_lists_every_round(parts):
    r = run(parts, "strategy:gossip_exponential")
    permutes = [c for c in r.found if c.kind == "collective-permute"]
    # 3 branches × 4 leaves, one peer each: every leaf's bytes once per branch.
    assert len(permutes) == 12 and {c.context for c in permutes} == {"conditional"}
    assert sorted(c.bytes_sent for c in permutes) == sorted(4 * n for n in r.leaves for _ in range(3))
    assert r.accountant == [(4.0 * sum(r.leaves), 4.0)] * 3
