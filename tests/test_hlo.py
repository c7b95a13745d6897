"""dtx.comm.hlo reads collectives, group sizes and bytes off compiled programs and HLO text.

Every figure below is counted by hand from the conventions of :mod:`dtx.comm.hlo` (those of
:mod:`dtx.comm.costmodel`'s accountant), for ``p`` devices per group and float32 data:

* all-reduce of ``e`` elements: the ring, ``2(p−1)·⌈e/p⌉·4`` bytes, ``2(p−1)`` rounds;
* all-gather of ``n`` bytes: ``(p−1)·n`` bytes, ``p−1`` rounds;
* reduce-scatter with a result of ``r`` bytes: ``(p−1)·r`` bytes, ``p−1`` rounds;
* all-to-all of ``n`` bytes: ``(p−1)/p·n`` bytes, ``p−1`` rounds;
* collective-permute of ``n`` bytes, each device the source of at most ``k`` pairs: ``k·n``, ``k`` rounds.

The compiled programs are built once per module (each compiles in well under a second).
"""

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from dtx.comm import hlo
from dtx.comm.hlo import COLLECTIVE_KINDS, Collective, HloError, Totals
from dtx.mesh import make_mesh

# Per-device operand sizes (float32 elements) used by every shard_map program below;
# 24 and 48 divide by every group size tested (2, 3, 4, 6, 8).
PSUM, GATHER, SCATTER, ALL_TO_ALL, PERMUTE = 40, 10, 24, 48, 10


def _five_collectives(mesh, axis):
    """One psum, all_gather, psum_scatter, all_to_all and ring ppermute over ``axis``."""
    p = mesh.shape[axis]
    axes = tuple(mesh.axis_names)

    def body(a, b, c, d, e):
        return (lax.psum(a, axis), lax.all_gather(b, axis, tiled=True), lax.psum_scatter(c, axis, tiled=True),
                lax.all_to_all(d, axis, 0, 0, tiled=True), lax.ppermute(e, axis, [(i, (i + 1) % p) for i in range(p)]))

    n = mesh.size
    args = [jnp.arange(n * size, dtype=jnp.float32) for size in (PSUM, GATHER, SCATTER, ALL_TO_ALL, PERMUTE)]
    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(axes), out_specs=P(axes), check_vma=False))
    return f.lower(*args).compile()


# (mesh spec, devices used, reduced axis) -> hand-counted (group size, bytes sent, rounds) per kind.
# p = group size; bytes: psum 2(p−1)·⌈40/p⌉·4, gather (p−1)·40, scatter (p−1)·(96/p), all-to-all (p−1)/p·192,
# ring permute 40 (one pair per source). A permute's group is every device taking part: each
# other-axis column runs its own ring, so all devices of the mesh take part.
CASES = {
    "full_8": ((("x", 8),), 8, "x", {
        "all-reduce": (8, 2 * 7 * 5 * 4, 14),  # ⌈40/8⌉ = 5
        "all-gather": (8, 7 * 40, 7),
        "reduce-scatter": (8, 7 * 12, 7),  # 96/8 = 12 bytes of result
        "all-to-all": (8, 7 * 192 // 8, 7),  # 168
        "collective-permute": (8, 40, 1)}),
    "4x2_over_4": ((("a", 4), ("b", 2)), 8, "a", {
        "all-reduce": (4, 2 * 3 * 10 * 4, 6),  # ⌈40/4⌉ = 10
        "all-gather": (4, 3 * 40, 3),
        "reduce-scatter": (4, 3 * 24, 3),
        "all-to-all": (4, 3 * 192 // 4, 3),  # 144
        "collective-permute": (8, 40, 1)}),
    "2x4_over_2": ((("a", 2), ("b", 4)), 8, "a", {
        "all-reduce": (2, 2 * 1 * 20 * 4, 2),  # ⌈40/2⌉ = 20
        "all-gather": (2, 1 * 40, 1),
        "reduce-scatter": (2, 1 * 48, 1),
        "all-to-all": (2, 1 * 192 // 2, 1),  # 96
        "collective-permute": (8, 40, 1)}),  # pairs (0,4),(4,0),...: 8 devices, one pair each
    "6_devices": ((("x", 6),), 6, "x", {
        "all-reduce": (6, 2 * 5 * 7 * 4, 10),  # ⌈40/6⌉ = 7: the ring pads 40 to 42
        "all-gather": (6, 5 * 40, 5),
        "reduce-scatter": (6, 5 * 16, 5),
        "all-to-all": (6, 5 * 192 // 6, 5),  # 160
        "collective-permute": (6, 40, 1)}),
    "3x2_over_3": ((("a", 3), ("b", 2)), 6, "a", {
        "all-reduce": (3, 2 * 2 * 14 * 4, 4),  # ⌈40/3⌉ = 14
        "all-gather": (3, 2 * 40, 2),
        "reduce-scatter": (3, 2 * 32, 2),
        "all-to-all": (3, 2 * 192 // 3, 2),  # 128
        "collective-permute": (6, 40, 1)}),
}
OPERAND_BYTES = {"all-reduce": 4 * PSUM, "all-gather": 4 * GATHER, "reduce-scatter": 4 * SCATTER,
                 "all-to-all": 4 * ALL_TO_ALL, "collective-permute": 4 * PERMUTE}


@pytest.fixture(scope="module")
def programs():
    out = {}
    for name, (spec, n, axis, _) in CASES.items():
        out[name] = _five_collectives(make_mesh(spec, devices=jax.devices()[:n]), axis)
    return out


@pytest.mark.parametrize("case", sorted(CASES))
def test_shard_map_collectives_hand_counted(programs, case):
    found = hlo.collectives(programs[case])
    expected = CASES[case][3]
    assert sorted(c.kind for c in found) == sorted(COLLECTIVE_KINDS)
    for c in found:
        group, sent, rounds = expected[c.kind]
        assert (c.group_size, c.operand_bytes, c.bytes_sent, c.rounds) == (
            group, OPERAND_BYTES[c.kind], sent, rounds), c
        assert c.context == "entry" and c.op_name.startswith("jit(body)/shard_map/")
    per_kind = hlo.communication(programs[case])
    assert per_kind == {kind: Totals(1, expected[kind][1], expected[kind][2]) for kind in COLLECTIVE_KINDS}
    assert hlo.total(programs[case]) == Totals(5, sum(v[1] for v in expected.values()),
                                               sum(v[2] for v in expected.values()))


def test_text_and_compiled_read_alike(programs):
    compiled = programs["full_8"]
    assert hlo.collectives(compiled.as_text()) == hlo.collectives(compiled)


def test_jit_named_sharding_collectives_inserted_by_xla():
    # x (64, 16) split 4 ways on rows, w (16, 32) split 2 ways on columns over a 4×2 mesh:
    # each device holds a (16, 16) block of x @ w, so the column sum is an all-reduce of
    # f32[16] over the 4 row devices and the replicated output an all-gather of f32[16]
    # over the 2 column devices. XLA prints both groups in the mesh form.
    mesh = make_mesh([("a", 4), ("b", 2)])
    f = jax.jit(lambda w, x: jnp.tanh(x @ w).sum(0),
                in_shardings=(NamedSharding(mesh, P(None, "b")), NamedSharding(mesh, P("a", None))),
                out_shardings=NamedSharding(mesh, P()))
    compiled = f.lower(jnp.ones((16, 32)), jnp.ones((64, 16))).compile()
    assert "replica_groups=mesh[" in compiled.as_text()
    found = {c.kind: c for c in hlo.collectives(compiled)}
    assert sorted(found) == ["all-gather", "all-reduce"]
    assert found["all-reduce"][2:6] == (4, 64, 2 * 3 * (16 // 4) * 4, 6)  # ⌈16/4⌉ = 4 → 96 bytes
    assert found["all-gather"][2:6] == (2, 64, 1 * 64, 1)


def test_scan_and_cond_give_loop_and_conditional_contexts():
    mesh = make_mesh([("a", 2), ("b", 4)])

    def body(x, i):
        def step(c, _):
            return c + lax.psum(c, "a"), None

        looped, _ = lax.scan(step, x, None, length=5)
        gathered = lax.cond(x.sum() > 0, lambda: lax.all_gather(x, "b", tiled=True)[:8], lambda: x)
        switched = lax.switch(i[0], [lambda: lax.ppermute(x, "a", [(0, 1), (1, 0)]),
                                     lambda: lax.psum_scatter(jnp.tile(x, 4), "b", tiled=True), lambda: x])
        return looped + gathered + switched

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(("a", "b")), P()), out_specs=P(("a", "b")),
                              check_vma=False))
    compiled = f.lower(jnp.ones(64), jnp.zeros(1, jnp.int32)).compile()
    found = {c.kind: c for c in hlo.collectives(compiled)}
    assert len(hlo.collectives(compiled)) == 4
    # The scan body runs 5 times: listed once (psum of f32[8] over 2: 2·1·4·4 bytes), with trips=5 from the
    # while's known trip count, and counted 5 times by the totals.
    assert found["all-reduce"][2:] == (2, 32, 32, 2, found["all-reduce"].op_name, "loop", 5)
    assert hlo.communication(compiled)["all-reduce"] == Totals(1, 5 * 32, 5 * 2, 0)
    # Both branches are listed, though at most one runs: all_gather of f32[8] over 4 (3·32),
    # psum_scatter of f32[32] over 4 (result f32[8]: 3·32), ppermute of f32[8] (one pair each).
    assert found["all-gather"][2:6] == (4, 32, 3 * 32, 3) and found["all-gather"].context == "conditional"
    assert found["reduce-scatter"][2:6] == (4, 128, 3 * 32, 3) and found["reduce-scatter"].context == "conditional"
    assert found["collective-permute"][2:6] == (8, 32, 32, 1)
    assert found["collective-permute"].context == "conditional"


def test_no_collectives_is_all_zeros():
    compiled = jax.jit(lambda x: jnp.sin(x) * 2).lower(jnp.ones(8)).compile()
    assert hlo.collectives(compiled) == []
    assert hlo.communication(compiled) == {kind: Totals(0, 0, 0) for kind in COLLECTIVE_KINDS}
    assert hlo.total(compiled) == Totals(0, 0, 0)


def test_lowered_stablehlo_is_refused():
    with pytest.raises(HloError, match="compile"):
        hlo.collectives(jax.jit(lambda x: x + 1).lower(jnp.ones(2)))


# ----------------------------------------------------------------------------- literal text
@pytest.mark.parametrize("text, leaves", [
    ("f32[64,16]{1,0}", [("f32", 1024)]),
    ("f32[]", [("f32", 1)]),
    ("pred[3]{0}", [("pred", 3)]),
    ("(f32[10]{0}, bf16[3,4]{1,0})", [("f32", 10), ("bf16", 12)]),
    ("((s32[], u8[7]{0}), c128[2]{0}, token[])", [("s32", 1), ("u8", 7), ("c128", 2), ("token", 1)]),
    ("f32[<=10,2]{1,0}", [("f32", 20)]),
    ("f8e4m3fn[5]{0}", [("f8e4m3fn", 5)]),
])
def test_parse_shape(text, leaves):
    assert hlo.parse_shape(text) == (leaves, len(text))


def test_bytes_of_dtypes():
    line = ("HloModule m, num_partitions=2\nENTRY %main (a: f32[4]) -> f32[4] {\n"
            "  %a = (f32[4]{0}, bf16[4]{0}, pred[4]{0}, c128[1]{0}, s64[2]{0}, s4[8]{0}, f16[]) parameter(0)\n"
            "  ROOT %g = f32[8]{0} all-gather(%a), channel_id=1, replica_groups={{0,1}}, "
            "use_global_device_ids=true\n}\n")
    # 16 + 8 + 4 + 16 + 16 + 4 (eight 4-bit) + 2 = 66 bytes; over 2 devices one copy is sent.
    assert hlo.collectives(line)[0][2:6] == (2, 66, 66, 1)


@pytest.mark.parametrize("kind, attrs, partitions, replicas, size", [
    ("all-reduce", "channel_id=1, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true", 8, 1, 4),
    ("all-reduce", "channel_id=1, replica_groups={}, use_global_device_ids=true", 8, 1, 8),
    ("all-reduce", "channel_id=1, replica_groups=[2,4]<=[8], use_global_device_ids=true", 8, 1, 4),
    ("all-gather", "channel_id=1, replica_groups=[4,2]<=[2,4]T(1,0), use_global_device_ids=true", 8, 1, 2),
    ("all-reduce", "channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}, "
                   "use_global_device_ids=true", 8, 1, 4),
    ("all-reduce", "channel_id=1, replica_groups=mesh['axis_0'=4,'axis_1'=1,'axis_2'=2] {'axis_0'}, "
                   "device_ids=([4,2]T(1,0)), use_global_device_ids=true", 8, 1, 4),
    ("all-gather", "channel_id=2, replica_groups=mesh['axis_0'=2,'axis_1'=4], device_ids=([4,2]T(1,0)) {'axis_0'}, "
                   "dimensions={0}, use_global_device_ids=true", 8, 1, 2),
    ("all-reduce", "channel_id=1, replica_groups=mesh['axis_0'=2,'axis_1'=2,'axis_2'=2] {'axis_0','axis_2'}, "
                   "use_global_device_ids=true", 8, 1, 4),
    ("all-reduce", "channel_id=1, replica_groups=mesh['x'=8] {'x':(2)4}, use_global_device_ids=true", 8, 1, 4),
    ("all-to-all", "channel_id=1, replica_groups={{0,2,4,6},{1,3,5,7}}", 8, 1, 4),  # groups of partitions
    ("all-to-all", "channel_id=1, replica_groups={}", 8, 2, 8),
    ("all-reduce", "replica_groups={}", 8, 4, 4),  # no channel: across replicas only
    ("all-reduce", "replica_groups={{0,1}}", 1, 4, 2),
    ("all-reduce", "channel_id=3, replica_groups={{0}}", 8, 1, 8),  # replica groups spanning every partition
    ("all-reduce", "channel_id=3, replica_groups={}", 4, 2, 8),
])
def test_group_size_formats(kind, attrs, partitions, replicas, size):
    assert hlo.group_size(kind, ", " + attrs, partitions, replicas) == size


# A module with every async form, a while loop, both conditional syntaxes, a call, a
# fusion and a computation no one calls.
MODULE = """HloModule jit_step, is_scheduled=true, entry_computation_layout={(f32[64]{0})->f32[64]{0}}, num_partitions=8
%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[] parameter(0)
  %y = f32[] parameter(1)
  ROOT %s = f32[] add(%x, %y)
}
%dead (d: f32[64]) -> f32[64] {
  %d = f32[64]{0} parameter(0)
  ROOT %ar.dead = f32[64]{0} all-reduce(%d), channel_id=9, replica_groups={}, use_global_device_ids=true, to_apply=%add
}
%wrapped_rs (w: f32[64]) -> f32[8] {
  %w = f32[64]{0} parameter(0)
  ROOT %rs.1 = f32[8]{0} reduce-scatter(%w), channel_id=4, replica_groups=[1,8]<=[8], use_global_device_ids=true, dimensions={0}, to_apply=%add
}
%body (t: (s32[], f32[64])) -> (s32[], f32[64]) {
  %t = (s32[], f32[64]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[64]{0} get-tuple-element(%t), index=1
  %ar.loop = f32[64]{0} all-reduce(%v), channel_id=5, replica_groups={{0,1},{2,3},{4,5},{6,7}}, use_global_device_ids=true, to_apply=%add, metadata={op_name="jit(step)/while/body/psum" source_line=3}
  ROOT %out = (s32[], f32[64]{0}) tuple(%i, %ar.loop)
}
%cond (c: (s32[], f32[64])) -> pred[] {
  %c = (s32[], f32[64]{0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %k = s32[] constant(3)
  ROOT %lt = pred[] compare(%ci, %k), direction=LT
}
%yes (a: f32[64]) -> f32[64] {
  %a = f32[64]{0} parameter(0)
  ROOT %cp.yes = f32[64]{0} collective-permute(%a), channel_id=6, source_target_pairs={{0,1},{0,2},{1,0},{2,0}}
}
%no (b: f32[64]) -> f32[64] {
  %b = f32[64]{0} parameter(0)
  ROOT %a2a = f32[64]{0} all-to-all(%b), channel_id=7, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}
}
%branch_a (q: f32[64]) -> f32[64] {
  ROOT %q = f32[64]{0} parameter(0)
}
%branch_b (r: f32[64]) -> f32[64] {
  %r = f32[64]{0} parameter(0)
  ROOT %ag.b = f32[64]{0} all-gather(f32[8]{0} %r), channel_id=8, replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, use_global_device_ids=true
}
%callee (z: f32[64]) -> f32[64] {
  %z = f32[64]{0} parameter(0)
  %ars = f32[64]{0} all-reduce-start(%z), channel_id=10, replica_groups={{0,1,2,3},{4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  ROOT %ard = f32[64]{0} all-reduce-done(%ars)
}
%fused (f: f32[64]) -> f32[64] {
  %f = f32[64]{0} parameter(0)
  ROOT %n = f32[64]{0} negate(%f)
}
ENTRY %main (p: f32[64]) -> f32[64] {
  %p = f32[64]{0} parameter(0)
  %zero = s32[] constant(0)
  %ags = (f32[64]{0}, f32[512]{0}) all-gather-start(%p), channel_id=1, replica_groups={}, dimensions={0}, use_global_device_ids=true
  %agd = f32[512]{0} all-gather-done(%ags)
  %cps = (f32[64]{0}, f32[64]{0}, u32[], u32[]) collective-permute-start(%p), channel_id=2, source_target_pairs={{0,1},{1,2},{2,3},{3,0}}
  %cpd = f32[64]{0} collective-permute-done(%cps)
  %rss = ((f32[64]{0}), f32[8]{0}) async-start(%p), calls=%wrapped_rs
  %rsu = ((f32[64]{0}), f32[8]{0}) async-update(%rss), calls=%wrapped_rs
  %rsd = f32[8]{0} async-done(%rsu), calls=%wrapped_rs
  %tup = (s32[], f32[64]{0}) tuple(%zero, %p)
  %loop = (s32[], f32[64]{0}) while(%tup), condition=%cond, body=%body
  %pred = pred[] constant(true)
  %tf = f32[64]{0} conditional(%pred, %p, %p), true_computation=%yes, false_computation=%no
  %idx = s32[] constant(1)
  %sw = f32[64]{0} conditional(%idx, %p, %p), branch_computations={%branch_a, %branch_b}
  %called = f32[64]{0} call(%p), to_apply=%callee
  %fu = f32[64]{0} fusion(%called), kind=kLoop, calls=%fused
  %small = f32[10]{0} slice(%p), slice={[0:10]}
  %half = bf16[3]{0} constant({1, 2, 3})
  %none = f32[0]{0} constant({})
  %ar.tuple = (f32[10]{0}, bf16[3]{0}, f32[0]{0}) all-reduce(%small, %half, %none), channel_id=11, replica_groups={{0,1,2,3,4,5,6,7}}, use_global_device_ids=true, to_apply=%add
  %solo = f32[64]{0} all-reduce(%p), channel_id=12, replica_groups={{0},{1},{2},{3},{4},{5},{6},{7}}, use_global_device_ids=true, to_apply=%add
  %empty = f32[0]{0} all-gather(f32[0]{0} %nothing), channel_id=13, replica_groups={}, dimensions={0}, use_global_device_ids=true
  ROOT %r = f32[64]{0} add(%cpd, %fu)
}
"""


def test_literal_module():
    found = {c.name: c for c in hlo.collectives(MODULE)}
    assert "ar.dead" not in found  # unreachable from ENTRY
    assert set(found) == {"ags", "cps", "rs.1", "ar.loop", "cp.yes", "a2a", "ag.b", "ars", "ar.tuple", "solo",
                          "empty"}
    expect = {
        # all-gather-start of f32[64] (256 bytes) over all 8 partitions: 7·256.
        "ags": ("all-gather", 8, 256, 7 * 256, 7, "entry"),
        # ring shift over 4 devices: one pair per source.
        "cps": ("collective-permute", 4, 256, 256, 1, "entry"),
        # inside async-start's computation, counted once (not again for async-update/-done):
        # result f32[8] = 32 bytes, 7·32.
        "rs.1": ("reduce-scatter", 8, 256, 7 * 32, 7, "entry"),
        # while body: f32[64] over 2: 2·1·32·4.
        "ar.loop": ("all-reduce", 2, 256, 2 * 1 * 32 * 4, 2, "loop"),
        # device 0 is the source of two pairs: 2·256 bytes, 2 rounds; devices {0,1,2}.
        "cp.yes": ("collective-permute", 3, 256, 2 * 256, 2, "conditional"),
        # all-to-all of 256 bytes over 8: 7/8·256.
        "a2a": ("all-to-all", 8, 256, 224, 7, "conditional"),
        # operand shape printed inline (f32[8], 32 bytes): 7·32.
        "ag.b": ("all-gather", 8, 32, 7 * 32, 7, "conditional"),
        # async all-reduce-start inside a call: f32[64] over 4: 2·3·16·4.
        "ars": ("all-reduce", 4, 256, 2 * 3 * 16 * 4, 6, "entry"),
        # tuple of f32[10], bf16[3] and f32[0] (40 + 6 + 0 bytes), the ring per element:
        # 2·7·⌈10/8⌉·4 + 2·7·⌈3/8⌉·2 + 0 = 112 + 28 bytes, 2(p−1) rounds once for the op.
        "ar.tuple": ("all-reduce", 8, 46, 2 * 7 * 2 * 4 + 2 * 7 * 1 * 2, 14, "entry"),
        # p = 1 and zero-size operands: listed, but nothing sent.
        "solo": ("all-reduce", 1, 256, 0, 0, "entry"),
        "empty": ("all-gather", 8, 0, 0, 0, "entry"),
    }
    for name, (kind, group, operand, sent, rounds, context) in expect.items():
        c = found[name]
        assert (c.kind, c.group_size, c.operand_bytes, c.bytes_sent, c.rounds, c.context) == (
            kind, group, operand, sent, rounds, context), c
    assert found["ar.loop"].op_name == "jit(step)/while/body/psum" and found["ags"].op_name == ""
    per_kind = hlo.communication(MODULE)
    # The while of the literal carries no known_trip_count: its all-reduce is counted once and said to be.
    assert found["ar.loop"].trips is None and found["ars"].trips == 1
    assert per_kind["all-reduce"] == Totals(4, 256 + 384 + 140 + 0, 2 + 6 + 14 + 0, unknown_trips=1)
    assert per_kind["collective-permute"] == Totals(2, 256 + 512, 1 + 2)
    assert hlo.total(MODULE).count == 11
    # The same loop with the count XLA writes on a compiled while: its body's all-reduce 3 times, the total too.
    counted = MODULE.replace("while(%tup), condition=%cond, body=%body",
                             'while(%tup), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}')
    assert {c.name: c.trips for c in hlo.collectives(counted)}["ar.loop"] == 3
    assert hlo.communication(counted)["all-reduce"] == Totals(4, 3 * 256 + 384 + 140, 3 * 2 + 6 + 14, 0)


def test_undefined_operand_and_missing_entry_are_errors():
    bad = MODULE.replace("all-gather(f32[0]{0} %nothing)", "all-gather(%nothing)")
    with pytest.raises(HloError, match="nothing"):
        hlo.collectives(bad)
    with pytest.raises(HloError, match="ENTRY"):
        hlo.collectives("HloModule m\n%f (a: f32[]) -> f32[] {\n  ROOT %a = f32[] parameter(0)\n}\n")


def test_collective_fields():
    assert Collective._fields == ("kind", "name", "group_size", "operand_bytes", "bytes_sent", "rounds",
                                  "op_name", "context", "trips")
    assert Totals._fields == ("count", "bytes_sent", "rounds", "unknown_trips")
    assert COLLECTIVE_KINDS == ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
