"""The shard_map step's accountant (``comm_bytes``/``comm_rounds``) against the compiled program (dtx.comm.hlo).

One table of cases: every allreduce algorithm with and without bucketing, every
compressor, every strategy, and loss-scaled steps, on a tiny MLP (64 → 16 → 10: gradient
leaves of 16, 1024, 10 and 160 float32 entries) over 8 workers. For each case the step is
compiled once, read by :mod:`dtx.comm.hlo`, and run for the one to three steps the comparison
needs.

The two must agree exactly, bytes and rounds, the step's averages included: every step
all-reduces its loss and accuracy (and, with loss scaling, every worker's finiteness flag)
as one float32 vector, which XLA merges into the gradients' psum where there is one (its
bytes, no rounds of its own) and runs alone otherwise. Where they disagree,
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

from dtx import models
from dtx.comm import algorithms, costmodel, hlo
from dtx import compress, optim, precision, strategies
from dtx import mesh as mesh_lib
from dtx.step.state import init_train_state
from dtx.step import StepSpec, make_train_step

P = 8
RING = 2 * (P - 1)  # rounds of one ring all-reduce
BUCKET = 1024  # bytes: the leaves (64, 4096, 40, 640 bytes) fall into buckets [b0], [k0], [b1, k1]
FLAT = [("data", P)]
TWO_LEVEL = [("node", 2), ("local", 4)]


def ring_bytes(sizes, itemsize=4):
    """Bytes one device sends in ring all-reduces of float32 arrays of these sizes (one per array)."""
    return sum(costmodel.expected_traffic("ring", n * itemsize, P, itemsize=itemsize).bytes_sent for n in sizes)


AVERAGES_BYTES = ring_bytes([2])  # loss and accuracy in one float32 vector: 2·7·⌈2/8⌉·4 = 56
AVERAGES_ROUNDS = RING  # where it runs alone (no gradient psum to ride in)
F16 = dict(policy="p=f32,c=f16", scaler=True)  # dynamic loss scaling: the vector carries the finiteness flag

CASES = {}
for _algorithm in algorithms.ALGORITHMS:
    _mesh = TWO_LEVEL if _algorithm == "hierarchical" else FLAT
    CASES[_algorithm] = dict(allreduce=_algorithm, mesh=_mesh)
    CASES[_algorithm + "+bucket"] = dict(allreduce=_algorithm, bucket=BUCKET, mesh=_mesh)
for _name in compress.COMPRESSORS:
    if _name != "none":  # none is the algorithm cases
        CASES["compress:" + _name] = dict(compressor=_name)
for _name, _settings, _steps in [("async", dict(staleness=2), 1), ("ssp", dict(staleness=2), 1),
                                 ("local_sgd", dict(period=2), 2), ("diloco", dict(period=2), 2),
                                 ("easgd", dict(period=2), 2), ("gossip", {}, 1),
                                 ("gossip_exponential", dict(topology="exponential"), 3),
                                 ("backup", dict(backup_workers=2), 1)]:
    CASES["strategy:" + _name] = dict(strategy=_name.split("_exp")[0], settings=_settings, steps=_steps)
# Streaming DiLoCo's fragments (a lax.switch) and 1-bit Adam/LAMB's two stages (a lax.cond): a step of each branch.
for _name, _settings in [("streaming_diloco", dict(period=2, fragments=2)), ("onebit_adam", dict(warmup_steps=1)),
                         ("onebit_lamb", dict(warmup_steps=1))]:
    CASES["strategy:" + _name] = dict(strategy=_name, settings=_settings, steps=2)
# The averaging in a branch with dtx's own ring: no combiner, so the two agree exactly.
CASES["strategy:local_sgd+ring"] = dict(strategy="local_sgd", settings=dict(period=2), steps=2, allreduce="ring")
# float16 with loss scaling: the flag rides in the psum (psum, randomk) or in the averages' own op (the rest).
for _name, _case in [("psum", {}), ("ring", dict(allreduce="ring")), ("compress:randomk", dict(compressor="randomk")),
                     ("compress:topk", dict(compressor="topk")), ("compress:sign", dict(compressor="sign"))]:
    CASES["loss_scale:" + _name] = {**_case, **F16}
assert {c["strategy"] for c in CASES.values() if "strategy" in c} | {"sync"} == set(strategies.STRATEGIES)


@dataclasses.dataclass
class Run:
    algorithm: str  # the configured allreduce
    accountant: list  # [(comm_bytes, comm_rounds)] per step run, as the metrics report them
    found: list  # dtx.comm.hlo.collectives of the compiled step
    leaves: list  # sizes of the gradient leaves, in tree order
    inner: int | None  # hierarchical's inner-axis size
    bucket: int  # the bucket size (0: none)
    logging: list  # [(comm_bytes_logging, comm_rounds_logging)] per step run: the metric averages' share

    @property
    def compiled(self):
        return sum(c.bytes_sent for c in self.found), sum(c.rounds for c in self.found)


@pytest.fixture(scope="module")
def parts():
    model = models.build_model("mlp", features=(16,), num_classes=10)
    rng = np.random.default_rng(0)
    batch = {"inputs": rng.normal(size=(64, 8, 8, 1)).astype(np.float32),
             "labels": rng.integers(0, 10, 64).astype(np.int32)}
    return model, optim.make_optimizer("sgd", 0.1), batch, {}, {}


def _initial_state(initial, case, model, tx, example, mesh, scaler, strategy, compressor):
    """The case's initial state, made by ``init_train_state`` once per distinct (mesh, strategy, compressor,
    loss scaling) and kept on the host in ``initial``: the cases that share them (the algorithms, with and
    without buckets) start from the same state, put back in place (no program run) as each step donates it."""
    key = (tuple(case.get("mesh", FLAT)), case.get("strategy"), tuple(sorted(case.get("settings", {}).items())),
           case.get("compressor"), case.get("policy"), case.get("scaler"))
    if key not in initial:
        state = init_train_state(model, tx, example, 0, mesh, loss_scaler=scaler,
                                 per_worker=StepSpec(strategy=strategy, compressor=compressor))
        initial[key] = jax.device_get(state), jax.tree.map(lambda x: x.sharding, state)
    host, shardings = initial[key]
    return jax.device_put(host, shardings)


def run(parts, name) -> Run:
    """Compile case ``name`` once, read it, run its steps (cached for the module)."""
    model, tx, host_batch, cache, initial = parts
    if name not in cache:
        case = CASES[name]
        mesh = mesh_lib.make_mesh(case.get("mesh", FLAT))
        policy = precision.parse_policy(case.get("policy", ""))
        scaler = precision.LossScaler(enabled=case.get("scaler", False))
        if case.get("scaler"):
            model = model.clone(dtype=policy.compute)
        compressor = compress.make_compressor(case.get("compressor", "none"))
        strategy = strategies.make_strategy(case.get("strategy", "sync"), **case.get("settings", {}))
        example = jax.ShapeDtypeStruct(host_batch["inputs"].shape, jnp.float32)
        state = _initial_state(initial, case, model, tx, example, mesh, scaler, strategy, compressor)
        algorithm = case.get("allreduce", "psum")
        step = make_train_step(model, tx, mesh, StepSpec(allreduce=algorithm, bucket_bytes=case.get("bucket", 0), compressor=compressor, strategy=strategy, policy=policy, loss_scaler=scaler))
        batch = jax.device_put(host_batch, mesh_lib.batch_sharding(mesh))
        compiled = step.lower(state, batch).compile()
        accountant, logging = [], []
        for _ in range(case.get("steps", 1)):
            state, metrics = compiled(state, batch)
            accountant.append((float(metrics["comm_bytes"]), float(metrics["comm_rounds"])))
            logging.append((float(metrics["comm_bytes_logging"]), float(metrics["comm_rounds_logging"])))
        cache[name] = Run(algorithm, accountant, hlo.collectives(compiled),
                          [x.size for x in jax.tree.leaves(state.params)],
                          mesh.shape["local"] if algorithm == "hierarchical" else None, case.get("bucket", 0),
                          logging)
    return cache[name]


# ----------------------------------------------------------------------------- the relations
def traffic(algorithm, sizes, inner=None):
    """Allreduces of float32 arrays of these sizes, one after another, in the cost model."""
    algorithm = "ring" if algorithm == "psum" else algorithm
    return costmodel.add_traffic(*(costmodel.expected_traffic(algorithm, 4 * n, P, inner, 4) for n in sizes))


def agree(r):
    """The accountant's figures of the last step run."""
    return r.accountant[-1]


def without_averages(r):
    """The last step's gradient traffic: the accountant's figures less the averages' own all-reduce."""
    nbytes, rounds = r.accountant[-1]
    return nbytes - AVERAGES_BYTES, rounds - AVERAGES_ROUNDS


def tree(r):
    # p = 8: ⌈lg p⌉ = 3 reduce and 3 broadcast ppermutes per allreduce; rank 0 sends in the 3 broadcast ones.
    assert sum(c.kind == "collective-permute" for c in r.found) == 2 * 3 * len(buckets_or_leaves(r))
    nbytes, rounds = without_averages(r)
    return 2 * nbytes + AVERAGES_BYTES, 2 * rounds + AVERAGES_ROUNDS


def buckets_or_leaves(r):
    if r.bucket:
        spec = [jax.ShapeDtypeStruct((n,), jnp.float32) for n in r.leaves]
        return costmodel.plan_buckets(spec, r.bucket)
    return r.leaves


def cast(r):
    # One combined all-reduce (the averages ride in it), of float32 where the accountant counts bfloat16.
    (nbytes, rounds), = r.accountant
    assert rounds == RING
    return 2 * (nbytes - AVERAGES_BYTES) + AVERAGES_BYTES, RING


def ssp(r):
    # Step 0 of ssp(staleness=2): ages (0 + ⌊3i/8⌋) mod 3 = 0,0,0,1,1,1,2,2, so f = 3/8 of the workers pull.
    dense = traffic("psum", r.leaves)
    pulled = (dense.bytes_sent * (1 + 3 / 8) / 2 + AVERAGES_BYTES, RING * (1 + 3 / 8) / 2)
    assert r.accountant == [pulled]
    return dense.bytes_sent + AVERAGES_BYTES, RING  # the whole psum, the averages riding in it


def every_branch(r):
    """Every step's mixing that the reader lists (each branch of the switch), and the averages once."""
    sent = sum(nbytes - AVERAGES_BYTES for nbytes, _ in r.accountant)
    rounds = sum(rounds - AVERAGES_ROUNDS for _, rounds in r.accountant)
    return sent + AVERAGES_BYTES, rounds + AVERAGES_ROUNDS


KNOWN_DIFFERENCES = {
    "tree": "a reading convention: the reader sums each ppermute's busiest sender, and the tree's senders change "
            "from level to level (2⌈lg p⌉ ppermutes per leaf), while the accountant takes the busiest device over "
            "the whole schedule (rank 0: the ⌈lg p⌉ broadcast sends): exactly twice the gradients' bytes and rounds",
    "tree+bucket": "the tree's reading convention (see tree), on one allreduce per bucket",
    "compress:cast": "a platform fact: XLA's CPU backend runs the bfloat16 all-reduce in float32 (the HLO converts "
                     "the operands to f32 first): twice the accountant's bfloat16 bytes; the accountant counts what a "
                     "backend with bfloat16 all-reduces sends (modelled)",
    "strategy:ssp": "modelled: the accountant counts a sharded parameter server that pulls only for expired caches, "
                    "(1 + f)/2 of the allreduce with f = 3/8 at step 0; the emulation runs the whole allreduce every "
                    "step (docs/strategies.md)",
    "strategy:gossip_exponential": "a reading convention: the reader lists every branch of the lax.switch over the "
                                   "⌈lg p⌉ = 3 mixing rounds, of which a step runs one: the sum of steps 0-2's "
                                   "mixing, and the averages once",
    "strategy:streaming_diloco": "a reading convention: the reader lists both fragments' branches of the lax.switch, "
                                 "of which a step runs one: the sum of steps 0-1's outer steps, and the averages once",
    "strategy:onebit_adam": "a reading convention: the reader lists both stages' branches of the lax.cond (the "
                            "gradient psum of the warm-up, the codes' all-to-all and all-gather after it): the sum of "
                            "steps 0-1, and the averages once",
    "strategy:onebit_lamb": "as strategy:onebit_adam",
}
PREDICT = {
    "tree": tree, "tree+bucket": tree, "compress:cast": cast, "strategy:ssp": ssp,
    "strategy:gossip_exponential": every_branch, "strategy:streaming_diloco": every_branch,
    "strategy:onebit_adam": every_branch, "strategy:onebit_lamb": every_branch,
}


def test_every_known_difference_has_its_relation():
    assert set(KNOWN_DIFFERENCES) == set(PREDICT) and set(PREDICT) <= set(CASES)


@pytest.mark.parametrize("name", list(CASES))
def test_accountant_against_compiled(parts, name):
    r = run(parts, name)
    predicted = PREDICT.get(name, agree)(r)
    assert r.compiled == predicted, (KNOWN_DIFFERENCES.get(name, "should agree"), r.accountant, r.compiled)


@pytest.mark.parametrize("name,operand", [(n, 8) for n in ("ring", "halving_doubling", "recursive_doubling", "tree",
                                                            "hierarchical", "compress:topk", "compress:sign")]
                         + [(n, 12) for n in ("loss_scale:ring", "loss_scale:compress:topk")])
def test_the_averages_are_one_small_all_reduce(parts, name, operand):
    # Where the gradients do not travel by psum, the averages run alone: one float32 vector, loss and
    # accuracy (8 bytes), and with loss scaling every worker's finiteness flag (12 bytes).
    reduces = [c for c in run(parts, name).found if c.kind == "all-reduce"]
    assert [(c.operand_bytes, c.bytes_sent, c.rounds) for c in reduces] == [(operand, AVERAGES_BYTES, RING)]


@pytest.mark.parametrize("name,averages", [("psum", 8), ("loss_scale:psum", 12)])
def test_psum_is_one_combined_all_reduce(parts, name, averages):
    """The gradients' psums and the averages (with the flag under loss scaling): one op, counted as one."""
    r = run(parts, name)
    (op,) = r.found
    assert (op.kind, op.operand_bytes, op.context) == ("all-reduce", 4 * sum(r.leaves) + averages, "entry")
    assert r.accountant == [(op.bytes_sent, RING)]


def test_cast_travels_as_float32_on_this_backend(parts):
    r = run(parts, "compress:cast")
    (op,) = r.found
    assert op.operand_bytes == 4 * sum(r.leaves) + 8  # not 2 bytes per entry: f32 on the wire


def test_powersgd_sends_two_packed_buffers(parts):
    """All P's with the vectors, then all Q's: two all-reduces whatever the number of leaves."""
    r = run(parts, "compress:powersgd")
    first, second = (4 * (16 * 4 + 10 * 4 + 16 + 10), 4 * (64 * 4 + 16 * 4))  # rank 4: P n×4, Q m×4
    # The averages (8 bytes) ride in one of them: XLA's combiner picks which.
    assert sorted(c.operand_bytes for c in r.found) in ([first + 8, second], [first, second + 8])


@pytest.mark.parametrize("name", ["strategy:local_sgd", "strategy:diloco", "strategy:easgd"])
def test_averaging_runs_in_a_branch_on_some_steps(parts, name):
    r = run(parts, name)
    assert r.accountant[0] == (AVERAGES_BYTES, RING) and r.accountant[1][0] > AVERAGES_BYTES  # step 1 averages
    contexts = sorted((c.context, c.operand_bytes) for c in r.found)
    assert contexts == [("conditional", 4 * sum(r.leaves)), ("entry", 8)]


@pytest.mark.parametrize("name, rounds", [("psum", 0), ("strategy:ssp", 0), ("ring", AVERAGES_ROUNDS),
                                          ("strategy:local_sgd", AVERAGES_ROUNDS), ("compress:topk", AVERAGES_ROUNDS)])
def test_the_metric_averages_are_reported_as_logging_traffic(parts, name, rounds):
    """comm_*_logging: the averages' all-reduce (riding in the gradients' psum: its bytes, no rounds; alone: a
    ring). A local-SGD step that does not average sends nothing else, which is what the simulated clock drops."""
    r = run(parts, name)
    assert r.logging == [(AVERAGES_BYTES, rounds)] * len(r.accountant)
    if name == "strategy:local_sgd":
        assert r.accountant[0] == r.logging[0]


def test_ring_averaging_in_a_branch(parts):
    r = run(parts, "strategy:local_sgd+ring")
    assert r.accountant[0] == (AVERAGES_BYTES, RING)
    permutes = [c for c in r.found if c.kind == "collective-permute"]
    assert len(permutes) == 4 * RING and {c.context for c in permutes} == {"conditional"}  # 4 leaves × 2(p−1)


def test_gossip_exponential_lists_every_round(parts):
    r = run(parts, "strategy:gossip_exponential")
    permutes = [c for c in r.found if c.kind == "collective-permute"]
    # 3 branches, one peer each: all the leaves, packed, once per branch.
    assert len(permutes) == 3 and {c.context for c in permutes} == {"conditional"}
    assert [c.bytes_sent for c in permutes] == [4 * sum(r.leaves)] * 3
    assert r.accountant == [(4.0 * sum(r.leaves) + AVERAGES_BYTES, 1.0 + RING)] * 3
