"""Communication read from the compiled program: the collectives XLA runs, and what each device sends.

:mod:`dtx.comm.costmodel`'s accountant says what dtx *means* to send; this module reads what the
compiled program *does* send, from its HLO text (``jax.jit(f).lower(*args).compile()``, or
its ``as_text()``), in the accountant's conventions so the figures compare. For ``p``
devices per replica group and ``n`` bytes of operand(s) on one device:

==================  ==================================================  ==========
kind                bytes one device sends                              rounds
==================  ==================================================  ==========
all-reduce          the ring, ``costmodel.expected_traffic("ring", n,    ``2(p−1)``
                    p, itemsize)``: ``2(p−1)·⌈e/p⌉`` of ``e`` elements
all-gather          ``(p−1)·n``                                         ``p−1``
reduce-scatter      ``(p−1)·`` result bytes                             ``p−1``
all-to-all          ``(p−1)/p·n``                                       ``p−1``
collective-permute  ``k·n``, ``k`` = most pairs one device is source of  ``k``
==================  ==================================================  ==========

An all-reduce's schedule (``psum``'s) is not visible in the HLO, the backend picks it, so
it is modelled as the ring, as :mod:`dtx.comm.costmodel` says. A tuple all-reduce (XLA's
all-reduce combiner merges many gradients into one op) is one schedule: the ring bytes of
each element, summed, and ``2(p−1)`` rounds once. ``p = 1`` or zero-size operands: 0 bytes,
0 rounds, still listed and counted. A permute pair from a device to itself is ignored;
sub-byte types count ``⌈elements·bits/8⌉`` bytes. :class:`Totals` add per-op figures, so
where the busiest sender changes from op to op (a binomial tree's reduce, then its
broadcast) they exceed what the busiest device sends in all.

* Result shapes precede the opcode; operands are names, their shapes looked up in the
  computation (parameters included).
* Async forms (``all-reduce-start``/``-done``, ``all-gather-…``, ``collective-permute-…``)
  count once, at the start; ``async-start(...), calls=%c`` counts the collective in ``%c``.
* Group size from ``replica_groups``: lists ``{{0,1},{2,3}}``; iota ``[groups,size]<=[dims]T(perm)``;
  mesh ``mesh['a'=4,'b'=2] {'a'}`` (the product of the listed axes); empty or absent: every
  device of the op's group mode (XLA's ``GetCollectiveOpGroupMode``: no ``channel_id``:
  ``replica_count``; all-to-all with one: ``num_partitions``; else ``replica_count·num_partitions``).
  With a ``channel_id`` but no ``use_global_device_ids=true``, all-reduce, all-gather and
  reduce-scatter groups list replicas, each spanning every partition (× ``num_partitions``).
* Only computations reachable from ``ENTRY`` count, once per call site. ``context``: ``"entry"``;
  ``"loop"`` in a while body or condition; ``"conditional"`` in a branch (listed whether or not
  it runs). Calls, fusions and async wrappers inherit their caller's; the innermost loop or
  conditional decides.
* **A collective in a loop runs once per trip.** ``trips`` is how many times it runs per call of
  the program: the product of the ``known_trip_count`` XLA writes on each enclosing ``while``
  (``n`` for the body, ``n + 1`` for the condition); ``None`` when a loop's count is unknown.
  :func:`communication` and :func:`total` count bytes and rounds ``trips`` times (once where
  unknown, and say how many such collectives there were: ``Totals.unknown_trips``).

Pure Python: nothing here imports JAX.
"""

from __future__ import annotations

import math
import re
from typing import Any, NamedTuple

from dtx.comm import costmodel

COLLECTIVE_KINDS: tuple[str, ...] = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_STARTS = {kind + "-start": kind for kind in COLLECTIVE_KINDS}  # async forms; their "-done" is not counted
_NO_CALLS = ("async-update", "async-done")  # they name the computation their async-start runs


class HloError(ValueError):
    """Text that is not an HLO module this reader understands."""


class Collective(NamedTuple):
    """One collective instruction of the compiled program (conventions: the module docstring)."""

    kind: str  # one of COLLECTIVE_KINDS
    name: str  # HLO instruction name, e.g. "all-reduce.3"
    group_size: int  # devices per replica group (collective-permute: devices taking part)
    operand_bytes: int  # bytes of the operand(s) on one device (tuple operands summed)
    bytes_sent: int  # bytes one device sends (max over devices)
    rounds: int  # message rounds one device takes part in
    op_name: str  # the instruction's metadata op_name ("" when absent)
    context: str  # "entry", "loop" (a while body or condition) or "conditional" (a branch, counted anyway)
    trips: int | None = 1  # times it runs per call of the program (enclosing loops' trip counts); None: unknown


class Totals(NamedTuple):
    """Collectives, and the bytes one device sends and the rounds it takes part in per call of the program
    (each collective ``trips`` times)."""

    count: int  # collective instructions
    bytes_sent: int
    rounds: int
    unknown_trips: int = 0  # collectives in a loop whose trip count XLA does not know: counted once


class _Instr(NamedTuple):
    name: str
    shape: list  # [(dtype, elements), ...]: the array leaves of its (tuple) shape
    opcode: str
    operands: list  # the operands' text: ["%x", ...], or ["f32[8]{0} %x", ...] when shapes are printed
    attrs: str  # everything after the operands


# ----------------------------------------------------------------------------- shapes
_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([^\]]*)\](\{[^}]*\})?")


def _bits(dtype: str) -> int:
    m = re.match(r"[a-z]+?(\d+)", dtype)  # f32, bf16, c64, s4, f8e4m3fn: the first number
    return 8 if dtype == "pred" else int(m.group(1)) if m else 0  # token: no bytes


def _nbytes(leaves: list) -> int:
    return sum(-(-n * _bits(dtype) // 8) for dtype, n in leaves)


def parse_shape(text: str, i: int = 0) -> tuple[list, int]:
    """The array leaves ``[(dtype, elements), ...]`` of the shape at ``text[i:]``, and where it ends."""
    while text[i:i + 1] in (" ", ","):
        i += 1
    if text.startswith("(", i):  # a tuple: its elements' leaves, in order
        leaves, i = [], i + 1
        while not text.startswith(")", i):
            if i >= len(text):
                raise HloError(f"unclosed tuple shape in {text!r}")
            sub, i = parse_shape(text, i)
            leaves += sub
            while text[i:i + 1] in (" ", ","):
                i += 1
        return leaves, i + 1
    m = _ARRAY.match(text, i)
    if not m:
        raise HloError(f"no shape at {text[i:i + 40]!r}")
    try:
        dims = [int(d.strip().removeprefix("<=")) for d in m.group(2).split(",") if d.strip()]
    except ValueError:
        raise HloError(f"unbounded dynamic shape {m.group(0)!r} has no byte size") from None
    return [(m.group(1), math.prod(dims))], m.end()


def _closing(text: str, i: int, pair: str = "()") -> int:
    """Index just past the bracket that closes the one at ``text[i]``."""
    depth = 0
    for j in range(i, len(text)):
        depth += (text[j] == pair[0]) - (text[j] == pair[1])
        if depth == 0:
            return j + 1
    raise HloError(f"unbalanced {pair[0]!r} in {text[i:i + 60]!r}")


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for j, ch in enumerate(text + ","):
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(text[start:j].strip())
            start = j + 1
    return [p for p in parts if p]


# ----------------------------------------------------------------------------- module structure
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*\)\s*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*")
_OPCODE = re.compile(r"\s*([a-z][\w\-]*)\(")
_IS_COLLECTIVE = re.compile(r"\s(%s)(-start)?\(" % "|".join(COLLECTIVE_KINDS))
_CALL = re.compile(r",\s*(body|condition|calls|to_apply|true_computation|false_computation)=%?([^\s,{}]+)")
_CALL_LIST = re.compile(r",\s*(branch_computations|called_computations)=\{([^}]*)\}")
_CONTEXT = {"body": "loop", "condition": "loop", "true_computation": "conditional",
            "false_computation": "conditional", "branch_computations": "conditional"}


def _instruction(line: str) -> _Instr | None:
    line = re.sub(r"/\*.*?\*/", "", line)  # long tuples carry /*index=5*/ markers
    m = _INSTR.match(line)
    if not m:
        return None
    try:
        shape, i = parse_shape(line, m.end())
        op = _OPCODE.match(line, i)
        end = _closing(line, op.end() - 1) if op else 0
    except HloError:
        if _IS_COLLECTIVE.search(line):
            raise
        return None  # an instruction this reader need not understand (not a collective)
    return _Instr(m.group(1), shape, op.group(1), _split_top(line[op.end():end - 1]), line[end:]) if op else None


def _parse_module(text: str) -> tuple[dict[str, list[_Instr]], str, int, int]:
    """``(computations, entry name, num_partitions, replica_count)`` of one HLO module's text."""
    header = re.search(r"^HloModule\b.*$", text, re.M)
    if not header:
        raise HloError("no 'HloModule' line: pass a compiled executable (jax.jit(f).lower(...).compile()) "
                       "or its as_text(), not the lowered StableHLO")
    setting = lambda key: int(m.group(1)) if (m := re.search(rf"\b{key}=(\d+)", header.group(0))) else 1  # noqa: E731
    computations: dict[str, list[_Instr]] = {}
    entry, current = None, None
    for line in text[header.end():].splitlines():
        if current is None:
            if m := _HEADER.match(line):
                current = computations.setdefault(m.group(2), [])
                entry = m.group(2) if m.group(1) else entry
        elif line.strip() == "}":
            current = None
        elif instr := _instruction(line):
            current.append(instr)
    if entry is None:
        raise HloError("the module has no ENTRY computation")
    return computations, entry, setting("num_partitions"), setting("replica_count")


# ----------------------------------------------------------------------------- replica groups
def group_size(kind: str, attrs: str, num_partitions: int = 1, replica_count: int = 1) -> int:
    """Devices per replica group of a collective, from its attributes (module docstring)."""
    size = None
    rest = attrs[m.end():] if (m := re.search(r"replica_groups=", attrs)) else ""
    if rest.startswith("{"):  # {{0,1},{2,3}}; {} is every device
        groups = re.findall(r"\{([^{}]*)\}", rest[1:_closing(rest, 0, "{}") - 1])
        size = max((len(re.findall(r"\d+", g)) for g in groups), default=None)
    elif rest.startswith("["):  # iota: [groups,size]<=[dims]T(perm)
        size = int(re.match(r"\[([\d,\s]+)\]", rest).group(1).split(",")[-1])
    elif rest.startswith("mesh["):  # mesh['a'=4,'b'=2] {'a'}, device_ids=(...) before or after the set
        sizes = {axis: int(n) for axis, n in re.findall(r"'([^']*)'=(\d+)", rest[:rest.index("]")])}
        chosen = re.search(r"\{([^{}]*)\}", rest[rest.index("]"):]).group(1)
        size = math.prod(int(sub) if sub else sizes[axis]  # a sub-axis 'a':(1)2 counts its own size
                         for axis, sub in re.findall(r"'([^']*)'(?::\(\d+\)(\d+))?", chosen))
    channel, flattened = "channel_id=" in attrs, "use_global_device_ids=true" in attrs
    if size is None:
        return replica_count if not channel else num_partitions if kind == "all-to-all" else (
            replica_count * num_partitions)
    if channel and not flattened and kind != "all-to-all":
        size *= num_partitions  # groups of replicas, each spanning every partition
    return size


# ----------------------------------------------------------------------------- traffic
def _ring_bytes(leaves: list, p: int) -> int:
    """The ring all-reduce of each array leaf, one after another (sub-byte types in whole bytes)."""
    return sum(costmodel.expected_traffic("ring", _nbytes([leaf]), p, itemsize=max(_bits(leaf[0]) // 8, 1)).bytes_sent
               for leaf in leaves if _nbytes([leaf]))


def _collective(kind: str, instr: _Instr, shapes: dict, context: str, partitions: int, replicas: int,
                trips: int | None) -> Collective:
    # An in-place collective-permute (slice_sizes=) also takes its output buffer and offsets.
    operands = instr.operands[:1] if kind == "collective-permute" and "slice_sizes=" in instr.attrs else instr.operands
    leaves = []
    for operand in operands:
        name = operand.split()[-1].lstrip("%")
        if " " in operand:
            leaves += parse_shape(operand)[0]
        elif name in shapes:
            leaves += shapes[name]
        else:
            raise HloError(f"operand %{name} of %{instr.name} is not defined in its computation")
    n = _nbytes(leaves)
    if kind == "collective-permute":
        found = re.search(r"source_target_pairs=(\{.*)", instr.attrs)
        body = found.group(1)[:_closing(found.group(1), 0, "{}")] if found else ""
        pairs = [(s, t) for s, t in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*\}", body) if s != t]
        p = len({d for pair in pairs for d in pair})
        k = max((sum(s == src for s, _ in pairs) for src, _ in pairs), default=0)
        sent, rounds = (n * k, k) if n else (0, 0)
    else:
        p = group_size(kind, instr.attrs, partitions, replicas)
        if kind == "all-reduce":
            sent = _ring_bytes(leaves, p)
        elif kind == "all-gather":
            sent = (p - 1) * n
        elif kind == "reduce-scatter":
            sent = (p - 1) * _nbytes(instr.shape)
        else:  # all-to-all: keeps 1/p of its operand, sends the rest
            sent = (p - 1) * n // p
        rounds = (2 if kind == "all-reduce" else 1) * (p - 1) if sent else 0
    op_name = re.search(r'\bop_name="((?:[^"\\]|\\.)*)"', instr.attrs)
    return Collective(kind, instr.name, p, n, sent, rounds, op_name.group(1) if op_name else "", context, trips)


_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')


def _called(instr: _Instr) -> list[tuple[str, str | None, int | None]]:
    """``(computation, context or None to inherit, runs per run of instr)`` for every computation ``instr``
    runs: a while's body its trip count, its condition one more (``None``: unknown); others once."""
    if instr.opcode in _NO_CALLS:
        return []
    attrs = re.sub(r"metadata=\{.*?\}(?=,\s*[a-z_]+=|$)", "", instr.attrs)
    count = _TRIP_COUNT.search(attrs)
    n = int(count.group(1)) if count else None
    runs = {"body": n, "condition": None if n is None else n + 1}
    calls = [(name, _CONTEXT.get(key), runs.get(key, 1)) for key, name in _CALL.findall(attrs)]
    for key, names in _CALL_LIST.findall(attrs):
        calls += [(name.strip().lstrip("%"), _CONTEXT.get(key), 1) for name in names.split(",") if name.strip()]
    return calls


def _module_collectives(text: str) -> list[Collective]:
    computations, entry, partitions, replicas = _parse_module(text)
    memo: dict[tuple[str, str, int | None], list[Collective]] = {}

    def walk(name: str, context: str, trips: int | None, callers: tuple[str, ...]) -> list[Collective]:
        if (name, context, trips) not in memo:
            if name in callers or name not in computations:
                raise HloError(f"computation %{name} is {'recursive' if name in callers else 'not defined'}")
            found, shapes = [], {}
            for instr in computations[name]:
                shapes[instr.name] = instr.shape
                kind = instr.opcode if instr.opcode in COLLECTIVE_KINDS else _STARTS.get(instr.opcode)
                if kind:
                    found.append(_collective(kind, instr, shapes, context, partitions, replicas, trips))
                for callee, how, runs in _called(instr):
                    inner = None if trips is None or runs is None else trips * runs
                    found += walk(callee, how or context, inner, callers + (name,))
            memo[name, context, trips] = found
        return memo[name, context, trips]

    return walk(entry, "entry", 1, ())


# ----------------------------------------------------------------------------- public
def collectives(program: Any) -> list[Collective]:
    """Every collective a compiled program runs, in text order, a called computation's at its call site.

    Args:
      program: a compiled executable (anything with ``.as_text()`` returning HLO text,
        e.g. ``jax.jit(f).lower(*args).compile()``) or HLO text.
    """
    text = program if isinstance(program, str) else program.as_text()
    starts = [m.start() for m in re.finditer(r"^HloModule\b", text, re.M)] or [0]
    return [c for a, b in zip(starts, starts[1:] + [len(text)]) for c in _module_collectives(text[a:b])]


def communication(program: Any) -> dict[str, Totals]:
    """Count, bytes one device sends and rounds per call of the program, per kind (a collective in a loop
    ``trips`` times); every kind of :data:`COLLECTIVE_KINDS` is a key."""
    found = collectives(program)
    return {kind: Totals(sum(c.kind == kind for c in found),
                         sum(c.bytes_sent * (c.trips or 1) for c in found if c.kind == kind),
                         sum(c.rounds * (c.trips or 1) for c in found if c.kind == kind),
                         sum(c.kind == kind and c.trips is None for c in found)) for kind in COLLECTIVE_KINDS}


def total(program: Any) -> Totals:
    """:func:`communication` summed over the kinds."""
    return Totals(*(sum(field) for field in zip(*communication(program).values())))
