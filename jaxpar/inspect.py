"""Reads a compiled XLA program and reports what it will do on the mesh: every collective with its
kind, the mesh axes it spans, its bytes, and how many times it runs per call (the trip counts of the
while loops around it), plus the per-device memory XLA planned."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
import sys
from collections.abc import Sequence

import numpy as np

log = logging.getLogger(__name__)

# Opcodes as XLA prints them. Async pairs (`all-reduce-start` / `-done`) are one collective, counted
# at its -start and named by its base kind; ops wrapped in `async-start(..., calls=%wrapped)` are
# found inside the wrapped computation.
_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "collective-permute", "all-to-all",
          "ragged-all-to-all", "collective-broadcast")

_COMP_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s+\(.*->.*\{\s*$")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_SHAPE = re.compile(r"\b([a-z][a-z0-9]*)\[([^\]]*)\]")
_OP_NAME = re.compile(r'op_name="((?:[^"\\]|\\.)*)"')
_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_SINGLE_CALL = re.compile(r"\b(body|condition|to_apply|calls|true_computation|false_computation)"
                          r"=%?([\w.\-]+)")
_LIST_CALL = re.compile(r"\b(branch_computations|called_computations|calls)=\{([^}]*)\}")
_IOTA_GROUPS = re.compile(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?")
_LIST_GROUPS = re.compile(r"replica_groups=\{((?:\{[\d,\s]*\}\s*,?\s*)*)\}")
_MESH_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]"
                          r"(?:,\s*device_ids=\(((?:[^()]|\([^()]*\))*)\))?\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{[\d,\s]*\}\s*,?\s*)*)\}")

# Bits per element by HLO element type; f8*/f4* variants are matched by prefix below.
_BITS = {"pred": 8, "bf16": 16, "c64": 64, "c128": 128, "token": 0, "tuple": 0}


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of the program, as one device sees it.

    `bytes` is the per-device result size (summed over a tuple result, e.g. a combined all-reduce);
    `context` marks context parallelism's collectives (`parallel.context`: the K/V all-gathers and
    their reduce-scatters, the ring's hops, the document-mask token gathers): over `data` alone, in
    the context groups of c consecutive data ranks (`_is_context`);
    `executions` is the product of the trip counts of the enclosing while loops (summed over call
    paths when a computation is reached more than once); a loop without a known trip count is
    counted once and sets `executions_known=False`. A while condition counts trip count + 1.
    """

    kind: str
    axes: tuple[str, ...]
    bytes: int
    in_loop: bool
    executions: int
    op_name: str
    executions_known: bool = True
    name: str = ""
    computation: str = ""
    context: bool = False

    @property
    def traffic(self) -> int:
        """Result bytes per call of the program: `bytes * executions`."""
        return self.bytes * self.executions


@dataclasses.dataclass(frozen=True)
class Memory:
    """Per-device bytes from `compiled.memory_analysis()`, and of the arguments those the compiled
    entry layout places in host memory (`host_argument_bytes`, see `host_argument_bytes`)."""

    argument_bytes: int
    output_bytes: int
    temp_bytes: int
    alias_bytes: int
    generated_code_bytes: int
    host_argument_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class Report:
    """Memory and collectives of one compiled program."""

    memory: Memory
    collectives: tuple[Collective, ...]

    def select(self, kind: str | Sequence[str] | None = None,
               axes: str | Sequence[str] | None = None, *, spans: str | None = None,
               in_loop: bool | None = None, context: bool | None = None) -> tuple[Collective, ...]:
        """Collectives matching every filter given.

        kind: one kind or several (any matches). axes: exactly this set of axes (a str is one
        axis; `()` selects collectives within single devices). spans: the collective's axes include
        this axis (e.g. every collective that crosses "data", alone or with other axes).
        in_loop: inside (True) or outside (False) any while loop. context: context parallelism's
        collectives (True) or the others (False).
        """
        kinds = (kind,) if isinstance(kind, str) else kind
        want = None if axes is None else frozenset((axes,) if isinstance(axes, str) else axes)
        return tuple(c for c in self.collectives
                     if (kinds is None or c.kind in kinds)
                     and (want is None or frozenset(c.axes) == want)
                     and (spans is None or spans in c.axes)
                     and (in_loop is None or c.in_loop == in_loop)
                     and (context is None or c.context == context))

    def traffic(self, kind: str | Sequence[str] | None = None,
                axes: str | Sequence[str] | None = None, *, spans: str | None = None,
                in_loop: bool | None = None, context: bool | None = None) -> int:
        """Sum of `bytes * executions` over the collectives `select(...)` picks (same filters)."""
        return sum(c.traffic for c in self.select(kind, axes, spans=spans, in_loop=in_loop, context=context))

    def to_dict(self) -> dict:
        """JSON-able form: {"memory": {...}, "collectives": [{...}, ...]} with axes as lists."""
        return {"memory": dataclasses.asdict(self.memory),
                "collectives": [dict(dataclasses.asdict(c), axes=list(c.axes))
                                for c in self.collectives]}

    def table(self):
        """A rich Table: identical collectives (kind, axes, bytes, loop, runs, op) merged into one row
        with a count, sorted by bytes per call, largest first."""
        from rich.table import Table

        rows: dict[tuple, int] = {}
        for c in self.collectives:
            axes = c.axes + ("(context)",) if c.context else c.axes
            key = (c.kind, axes, c.bytes, c.in_loop, c.executions, c.executions_known,
                   _short_op(c.op_name))
            rows[key] = rows.get(key, 0) + 1
        table = Table(title=f"{len(self.collectives)} collectives, "
                            f"{_human(self.traffic())} result bytes per call",
                      caption="bytes: result per device; runs: per call of the program "
                              "(+: some loop's trip count unknown, counted once); "
                              "data (context): context parallelism's groups")
        table.add_column("kind", no_wrap=True)
        table.add_column("axes", no_wrap=True)
        for col in ("count", "bytes", "loop", "runs", "bytes/call"):
            table.add_column(col, justify="right", no_wrap=True)
        table.add_column("op_name", overflow="fold")
        ordered = sorted(rows.items(), key=lambda kv: -kv[0][2] * kv[0][4] * kv[1])
        for (kind, axes, nbytes, in_loop, runs, known, op), count in ordered:
            table.add_row(kind, ",".join(axes).replace(",(context)", " (context)") or "-", str(count), _human(nbytes),
                          "yes" if in_loop else "", f"{runs}" + ("" if known else "+"),
                          _human(nbytes * runs * count), op)
        return table


def analyze(compiled, mesh, context: int | None = None) -> Report:
    """Report of `compiled` (a `jax.stages.Compiled`) whose devices form `mesh`; `context` is the
    step's `parallel.context` (c), which names context parallelism's collectives (`_is_context`:
    by their groups alone while c < mesh.data; c == mesh.data needs it)."""
    stats = compiled.memory_analysis()
    if stats is None:  # some backends do not implement it; say so rather than fail the collectives
        log.warning("this backend gives no memory analysis; memory is reported as 0")
    text = compiled.as_text()
    memory = Memory(*(int(getattr(stats, f"{name}_size_in_bytes", 0) or 0) for name in
                      ("argument", "output", "temp", "alias", "generated_code")), host_argument_bytes(text))
    return Report(memory, parse_hlo(text, mesh, _device_order(compiled), context))


def host_argument_bytes(hlo_text: str) -> int:
    """Per-device bytes of the program's arguments in host memory: the entry parameters whose
    layout has memory space 5 (`{1,0:S(5)}`, XLA's host space; jaxpar's `parallel.offload`).
    XLA:CPU's `memory_analysis()` counts them among the arguments (its host argument bytes are 0),
    so they are read from the compiled entry layout: on CPU the device's share of the arguments is
    `argument_bytes - host_argument_bytes`."""
    m = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
    if m is None:
        return 0
    return sum(_bytes(shape) for shape in re.findall(r"\w+\[[^\]]*\]\{[^}]*S\(5\)[^}]*\}", m.group(1)))


def _device_order(compiled):
    """The devices of the program's device assignment, in order, or None (then mesh order).

    Replica-group ids index this list. For a jit over mesh M it is M.devices.flat; it is read from
    the executable (a private attribute) so a program placed any other way is still mapped right.
    """
    try:
        return list(compiled._executable._unloaded_executable.device_list)
    except Exception:  # noqa: BLE001 - private API; the mesh order is the documented fallback
        return None


def parse_hlo(hlo_text: str, mesh, device_order: Sequence | None = None,
              context: int | None = None) -> tuple[Collective, ...]:
    """Collectives of an HLO module's text, in program order.

    `context`: the step's `parallel.context` c, or None (then a collective over proper groups of
    consecutive data ranks is context parallelism's, whatever their size; see `_is_context`).

    Device ids in replica groups are positions in the program's device assignment: id i is
    `device_order[i]`, by default `mesh.devices.flat[i]`; its mesh coordinates give the axes.
    """
    comps, entry = _split_computations(hlo_text)
    coords = _coords(mesh, device_order)
    names = tuple(mesh.axis_names)
    runs = _runs(comps, entry)

    out = []
    for comp, lines in comps.items():
        done_shapes = {}
        for name, rest in lines:
            shape, opcode = _shape_and_opcode(rest)
            if opcode.endswith("-done"):
                operand = re.search(r"\(\s*%?([\w.\-]+)", rest[rest.index(opcode) + len(opcode):])
                if operand:
                    done_shapes[operand.group(1)] = shape
        for name, rest in lines:
            shape, opcode = _shape_and_opcode(rest)
            kind = opcode[:-len("-start")] if opcode.endswith("-start") else opcode
            if kind not in _KINDS:
                continue
            executions, in_loop, known, reached = runs(comp)
            if not reached:
                continue  # dead computation, never called from the entry
            axes = _axes(kind, rest, coords, names, mesh.devices.shape)
            op = _OP_NAME.search(rest)
            ctx = _is_context(kind, rest, coords, names, mesh.devices.shape, axes, in_loop, context)
            out.append(Collective(kind, axes, _bytes(done_shapes.get(name, shape)), in_loop,
                                  executions, op.group(1) if op else "", known, name, comp, ctx))
    return tuple(out)


def _runs(comps: dict[str, list[tuple[str, str]]], entry: str | None):
    """`runs(computation) -> (runs per call of the program summed over call paths from the entry,
    some path is in a loop, every trip count on the way is known, reachable at all)`."""
    # Calls between computations: callee -> [(caller, factor, known, loop)].
    callers: dict[str, list[tuple[str, int, bool, bool]]] = {}
    for comp, lines in comps.items():
        for _, rest in lines:
            for callee, factor, known, loop in _calls(rest):
                callers.setdefault(callee, []).append((comp, factor, known, loop))
    roots = {entry} if entry else {c for c in comps if c not in callers}
    memo: dict[str, tuple[int, bool, bool, bool]] = {}

    def runs(comp: str) -> tuple[int, bool, bool, bool]:
        if comp in memo:
            return memo[comp]
        if comp in roots:
            memo[comp] = (1, False, True, True)
            return memo[comp]
        memo[comp] = (0, False, True, False)  # (no recursion through a computation being counted)
        total, in_loop, known, reached = 0, False, True, False
        for caller, factor, trip_known, loop in callers.get(comp, ()):
            n, caller_in_loop, caller_known, caller_reached = runs(caller)
            if caller_reached:
                total += n * factor
                in_loop = in_loop or caller_in_loop or loop
                known = known and trip_known and caller_known
                reached = True
        memo[comp] = (total, in_loop, known, reached)
        return memo[comp]

    return runs


def dot_flops(hlo_text: str) -> tuple[int, bool]:
    """(FLOPs of every dot of an HLO module's text per call of the program, 2 × the output's
    elements × the contracted size, each dot counted as often as it runs: loop bodies times their
    trip counts, which `compiled.cost_analysis()` counts once; whether every trip count was known).
    The matmul work of a program whose loops XLA keeps, e.g. a tiled attention's scan over tiles."""
    comps, entry = _split_computations(hlo_text)
    runs = _runs(comps, entry)
    total, all_known = 0, True
    for comp, lines in comps.items():
        shapes = {name: _shape_and_opcode(rest)[0] for name, rest in lines}
        for name, rest in lines:
            shape, opcode = _shape_and_opcode(rest)
            if opcode != "dot":
                continue
            n, _, known, reached = runs(comp)
            if not reached:
                continue
            lhs = _operands(rest)[0]
            lhs_dims = _dims(shapes.get(lhs, ""))
            contracting = re.search(r"lhs_contracting_dims=\{([^}]*)\}", rest)
            k = math.prod(lhs_dims[int(i)] for i in _ints(contracting.group(1))) if contracting else 1
            total += 2 * math.prod(_dims(shape)) * k * n
            all_known = all_known and known
    return total, all_known


def _dims(shape: str) -> list[int]:
    """The dimensions of an array shape such as 'f32[4,64]{1,0}'."""
    m = _SHAPE.search(shape)
    return [int(d.lstrip("<=")) for d in m.group(2).split(",") if d.strip()] if m else []


def device_traffic(hlo_text: str, mesh, device_order: Sequence | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each device sends and receives per call of the program, as arrays shaped like
    `mesh.devices` (a device's mesh position indexes its entry).

    A collective-permute moves its result bytes B from each source to its target, as the HLO's
    source_target_pairs say (exact). Group collectives follow the ring model, the same for every
    member of a group of n (B: a member's result bytes): all-reduce 2B(n-1)/n, all-gather
    B(n-1)/n, reduce-scatter B(n-1), all-to-all B(n-1)/n, each sent and received; a
    collective-broadcast is counted as a star (the group's first device sends B to each other).
    """
    comps, _ = _split_computations(hlo_text)
    text = {(comp, name): rest for comp, lines in comps.items() for name, rest in lines}
    coords = _coords(mesh, device_order)
    flat = np.ravel_multi_index(tuple(coords.T), mesh.devices.shape)  # device id -> mesh position
    sent, received = np.zeros(mesh.devices.size), np.zeros(mesh.devices.size)
    for c in parse_hlo(hlo_text, mesh, device_order):
        rest, b = text[(c.computation, c.name)], c.bytes * c.executions
        if c.kind == "collective-permute":
            m = _PAIRS.search(rest)
            for source, target in (_int_lists(m.group(1)) if m else []):
                if source != target:
                    sent[flat[source]] += b
                    received[flat[target]] += b
            continue
        for group in _replica_groups(rest, len(coords)):
            n = len(group)
            if n < 2:
                continue
            if c.kind == "collective-broadcast":
                sent[flat[group[0]]] += b * (n - 1)
                received[flat[group[1:]]] += b
                continue
            each = {"all-reduce": 2 * b * (n - 1) / n, "reduce-scatter": b * (n - 1)}.get(c.kind, b * (n - 1) / n)
            sent[flat[group]] += each
            received[flat[group]] += each
    return sent.reshape(mesh.devices.shape), received.reshape(mesh.devices.shape)


def compiled_device_traffic(compiled, mesh) -> tuple[np.ndarray, np.ndarray]:
    """`device_traffic` of a `jax.stages.Compiled` whose devices form `mesh`."""
    return device_traffic(compiled.as_text(), mesh, _device_order(compiled))


def collectives_in_flight(hlo_text: str) -> int:
    """The most collectives one device's program can have in flight at once: the largest set of
    collectives none of which depends on another (a while loop or conditional counts as the most its
    bodies can have). XLA's CPU runtime starts a device's collectives in program order but runs
    independent ones side by side, each holding a thread of the shared pool while it waits for
    its group (`jaxpar.mesh.cpu_threads_needed`)."""
    comps, entry = _split_computations(hlo_text)
    memo: dict[str, int] = {}

    def width(name: str) -> int:
        if name in memo:
            return memo[name]
        memo[name] = 0  # no recursion through a computation being measured
        before: dict[str, set[str]] = {}  # instruction -> the collectives it (transitively) depends on
        weights: dict[str, int] = {}
        for instr, rest in comps.get(name, []):  # in order: operands come before their users
            _, opcode = _shape_and_opcode(rest)
            deps: set[str] = set()
            for o in _operands(rest):
                if o in before:
                    deps |= before[o] | ({o} if o in weights else set())
            before[instr] = deps
            kind = opcode.removesuffix("-start")
            if kind in _KINDS or (opcode == "async-start" and any(k in rest for k in _KINDS)):
                weights[instr] = 1
            elif opcode in ("while", "conditional", "call"):
                inner = max((width(c) for c, *_ in _calls(rest) if c in comps), default=0)
                if inner:
                    weights[instr] = inner
        memo[name] = _max_antichain(weights, before)
        return memo[name]

    return width(entry) if entry else 0


def _operands(rest: str) -> list[str]:
    """Names of an instruction's operands (and control predecessors)."""
    _, opcode = _shape_and_opcode(rest)
    start = rest.find(opcode + "(") + len(opcode) + 1
    depth, i = 1, start
    while i < len(rest) and depth:
        depth += (rest[i] == "(") - (rest[i] == ")")
        i += 1
    names = re.findall(r"%([\w.\-]+)", rest[start:i - 1])
    control = re.search(r"control-predecessors=\{([^}]*)\}", rest)
    return names + (re.findall(r"%?([\w.\-]+)", control.group(1)) if control else [])


def _max_antichain(weights: dict[str, int], before: dict[str, set[str]]) -> int:
    """Largest total weight of pairwise independent nodes (a node of weight w stands for w
    independent copies): Dilworth, the copies less a maximum matching of `a before b`."""
    copies = [(n, k) for n, w in weights.items() for k in range(w)]
    later = {c: [d for d in copies if c[0] in before[d[0]]] for c in copies}
    match: dict = {}

    def augment(c, seen) -> bool:
        for d in later[c]:
            if d not in seen:
                seen.add(d)
                if d not in match or augment(match[d], seen):
                    match[d] = c
                    return True
        return False

    return len(copies) - sum(augment(c, set()) for c in copies)


def _split_computations(text: str) -> tuple[dict[str, list[tuple[str, str]]], str | None]:
    """{computation: [(instruction name, text after '=')]} and the ENTRY computation's name."""
    comps: dict[str, list[tuple[str, str]]] = {}
    entry, current = None, None
    for line in text.splitlines():
        header = _COMP_HEADER.match(line)
        if header and current is None:
            current = header.group(2)
            comps[current] = []
            entry = current if header.group(1) else entry
        elif current is not None and line.startswith("}"):
            current = None
        elif current is not None and (m := _INSTR.match(line)):
            comps[current].append((m.group(1), m.group(2)))
    return comps, entry


def _shape_and_opcode(rest: str) -> tuple[str, str]:
    """Split 'f32[4]{0} all-reduce(...)' or '(f32[], s32[]) while(...)' into shape and opcode."""
    if rest.startswith("("):
        depth = 0
        for i, ch in enumerate(rest):
            depth += (ch == "(") - (ch == ")")
            if depth == 0:
                break
        shape, tail = rest[:i + 1], rest[i + 1:]
    else:
        shape, _, tail = rest.partition(" ")
    opcode = re.match(r"\s*([\w\-]+)", tail)
    return shape, opcode.group(1) if opcode else ""


def _calls(rest: str):
    """(callee, factor, trip count known, is a loop) for each computation this instruction calls."""
    _, opcode = _shape_and_opcode(rest)
    trip = _TRIP.search(rest)
    n = int(trip.group(1)) if trip else None
    for attr, callee in _SINGLE_CALL.findall(rest):
        if opcode == "while" and attr in ("body", "condition"):
            # The condition runs once more than the body: n body runs need n + 1 tests.
            factor = 1 if n is None else n + (attr == "condition")
            yield callee, factor, n is not None, True
        else:
            yield callee, 1, True, False
    for _, group in _LIST_CALL.findall(rest):
        # A branch of a conditional is counted as if taken: an upper bound of one run per call.
        for callee in re.findall(r"%?([\w.\-]+)", group):
            yield callee, 1, True, False


def _bytes(shape: str) -> int:
    """Bytes of an HLO shape such as 'f32[4,64]{1,0}' or '(f32[4], bf16[2,3])'."""
    total_bits = 0
    for dtype, dims in _SHAPE.findall(shape):
        elements = math.prod(int(d.lstrip("<=")) for d in dims.split(",") if d.strip())
        total_bits += elements * _dtype_bits(dtype)
    return (total_bits + 7) // 8


def _dtype_bits(dtype: str) -> int:
    if dtype in _BITS:
        return _BITS[dtype]
    if dtype.startswith("f8"):
        return 8
    if dtype.startswith("f4"):
        return 4
    if m := re.fullmatch(r"[suf](\d+)", dtype):
        return int(m.group(1))
    raise ValueError(f"unknown HLO element type {dtype!r}; add its size to jaxpar.inspect._BITS")


def _coords(mesh, device_order) -> np.ndarray:
    """[device id, mesh axis] -> coordinate, for ids in the program's device assignment."""
    shape = mesh.devices.shape
    if device_order is None:
        return np.array(np.unravel_index(np.arange(mesh.devices.size), shape)).T
    where = {d.id: idx for idx, d in np.ndenumerate(mesh.devices)}
    missing = [d for d in device_order if d.id not in where]
    if missing:
        raise ValueError(f"the program runs on devices {missing} that are not in the mesh "
                         f"{dict(mesh.shape)}; pass the mesh the program was compiled for")
    return np.array([where[d.id] for d in device_order])


def _axes(kind, rest, coords, names, mesh_shape) -> tuple[str, ...]:
    """Mesh axes along which device coordinates vary inside a group (or between a permute's
    source and target), in mesh axis order."""
    if kind == "collective-permute":
        m = _PAIRS.search(rest)
        groups = _int_lists(m.group(1)) if m else []
    else:
        groups = _replica_groups(rest, len(coords))
    if any(i >= len(coords) for group in groups for i in group):
        raise ValueError(f"a collective names device ids beyond the {len(coords)} devices of the "
                         f"mesh {dict(zip(names, mesh_shape))}; pass the mesh the program was "
                         "compiled for")
    varies = np.zeros(len(names), bool)
    for group in groups:
        if len(group) > 1:
            c = coords[np.asarray(group)]
            varies |= (c != c[0]).any(axis=0)
    return tuple(n for n, v in zip(names, varies) if v)


_CONTEXT_KINDS = ("all-gather", "reduce-scatter", "collective-permute")


def _is_context(kind, rest, coords, names, mesh_shape, axes, in_loop, c) -> bool:
    """Whether a collective is context parallelism's (`jaxpar.parallel.context`): an all-gather, a
    reduce-scatter or a collective-permute over `data` alone whose groups (a permute's source and
    target pairs) lie in the context groups, c consecutive data ranks each.

    - c < data (or c not given): read from the groups alone: every group (pair) within one block
      of consecutive data ranks smaller than the axis (c given: of c ranks), the other coordinates
      fixed. Nothing else in jaxpar runs over part of `data`.
    - c == data: a context group is the whole axis, as the gradient reduction's and ZeRO's groups
      are; named by the config: the permutes over `data` (only the ring permutes there) and the
      all-gathers and reduce-scatters over `data` inside a loop (the layers' scan). Under ZeRO-3,
      whose per-layer weight gathers and gradient scatters are such too, they cannot be told apart
      from the HLO and are named context's with them.
    """
    if kind not in _CONTEXT_KINDS or axes != ("data",) or c == 1:
        return False
    d_axis = names.index("data")
    d = mesh_shape[d_axis]
    if c is not None and c == d:
        return kind == "collective-permute" or in_loop
    if kind == "collective-permute":  # the groups: the devices the pairs connect
        m = _PAIRS.search(rest)
        groups = _components([p for p in (_int_lists(m.group(1)) if m else []) if p[0] != p[1]])
    else:
        groups = [g for g in _replica_groups(rest, len(coords)) if len(g) > 1]
    for group in groups:
        data = sorted(set(coords[np.asarray(group), d_axis].tolist()))
        n = len(data)
        if (c is not None and n != c) or n >= d or data[0] % n or data != list(range(data[0], data[0] + n)):
            return False
    return bool(groups)


def _components(pairs: list[list[int]]) -> list[list[int]]:
    """The devices a permute's (source, target) pairs connect, as groups."""
    parent: dict[int, int] = {}

    def root(i):
        while parent.setdefault(i, i) != i:
            i = parent[i]
        return i

    for a, b in pairs:
        parent[root(a)] = root(b)
    out: dict[int, list[int]] = {}
    for i in list(parent):
        out.setdefault(root(i), []).append(i)
    return list(out.values())


def _replica_groups(rest: str, num_devices: int) -> list[list[int]]:
    """Replica groups as lists of device ids, from any of the three formats XLA prints."""
    if m := _IOTA_GROUPS.search(rest):
        # [G,S]<=[dims]T(perm): iota reshaped to dims, transposed, read as G groups of S.
        groups, dims = _ints(m.group(1)), _ints(m.group(2))
        ids = np.arange(math.prod(dims)).reshape(dims)
        if m.group(3):
            ids = ids.transpose(_ints(m.group(3)))
        return ids.reshape(-1, groups[-1]).tolist()
    if m := _MESH_GROUPS.search(rest):
        return _mesh_replica_groups(*m.groups())
    if m := _LIST_GROUPS.search(rest):
        groups = _int_lists(m.group(1))
        return groups or [list(range(num_devices))]  # `{}` means one group of every device
    if "replica_groups=" in rest:
        raise ValueError(f"unrecognised replica_groups format in HLO instruction: {rest[:300]}")
    return [list(range(num_devices))]  # no groups printed: every device takes part


def _mesh_replica_groups(axes_text: str, ids_text: str | None, group_text: str):
    """Groups of `mesh['a'=4,'b'=2], device_ids=(...) {'a', 'b':(1)2}`: devices that differ only
    along the listed axes (or sub-axes, `name:(pre_size)size`) of that mesh form one group."""
    names, sizes = [], []
    for item in filter(None, (s.strip() for s in axes_text.split(","))):
        name, _, size = item.rpartition("=")
        names.append(name.strip("'\""))
        sizes.append(int(size))
    ids = _device_ids(ids_text, sizes)
    refs: dict[int, list[tuple[int, int] | None]] = {}
    for ref in re.finditer(r"['\"]?([^'\",:\s]+)['\"]?(?::\((\d+)\)(\d+))?", group_text):
        dim = names.index(ref.group(1))
        refs.setdefault(dim, []).append(
            (int(ref.group(2)), int(ref.group(3))) if ref.group(2) else None)
    # Split each grouped mesh dim into [pre, size, post] pieces so sub-axes become whole dims.
    split, grouped = [], []
    for dim, full in enumerate(sizes):
        subs = refs.get(dim)
        if subs is None or None in subs:
            grouped += [len(split)] if subs is not None else []
            split.append(full)
            continue
        prefix = 1
        for pre, size in sorted(subs):
            if pre != prefix:
                split.append(pre // prefix)
            grouped.append(len(split))
            split.append(size)
            prefix = pre * size
        if prefix != full:
            split.append(full // prefix)
    kept = [d for d in range(len(split)) if d not in grouped]
    group_size = math.prod(split[d] for d in grouped)
    return ids.reshape(split).transpose(kept + grouped).reshape(-1, group_size).tolist()


def _device_ids(text: str | None, sizes: list[int]) -> np.ndarray:
    """The mesh's device ids: iota by default, `[dims]T(perm)` (iota reshaped and transposed, with
    an optional `<=[dims]`), or an explicit list."""
    n = math.prod(sizes)
    if not text:
        return np.arange(n)
    if m := re.fullmatch(r"\s*\[([\d,]+)\](?:<=\[([\d,]+)\])?(?:T\(([\d,]+)\))?\s*", text):
        dims = _ints(m.group(2) or m.group(1))
        ids = np.arange(n).reshape(dims)
        return (ids.transpose(_ints(m.group(3))) if m.group(3) else ids).ravel()
    return np.array(_ints(re.sub(r"[^\d,]", "", text)))


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t.strip()]


def _int_lists(text: str) -> list[list[int]]:
    return [_ints(g) for g in re.findall(r"\{([\d,\s]*)\}", text)]


def _short_op(op_name: str, width: int = 60) -> str:
    """Drop the 'jit(f)/' prefix and keep the tail that says where in the program the op sits."""
    op = re.sub(r"^jit\([^)]*\)/", "", op_name)
    return op if len(op) <= width else "…" + op[-(width - 1):]


def _human(n: float) -> str:
    if n < 1024:
        return f"{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}"


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m jaxpar.inspect [--config FILE] [--set key=value]... [--json]`: compile one
    training step of a config and print its memory and collectives."""
    from jaxpar.cli import Parser

    parser = Parser(
        prog="python -m jaxpar.inspect",
        description="Compile one training step of a config and print its per-device memory and "
                    "its collectives: kind, mesh axes, bytes, and runs per step.")
    parser.add_argument("--config", help="YAML config file (default: the built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field by dotted name; repeatable")
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    # Imported here: they pull in the model and the step, which this module's parsing never needs.
    from jaxpar.config import JaxparError, load_config
    try:
        config = load_config(args.config, args.set)
        from jaxpar.mesh import use_cpu_devices
        from jaxpar.xla_flags import apply as apply_xla_flags
        # Before anything starts a JAX backend: the collectives compile as training's do.
        xla = apply_xla_flags(config)
        use_cpu_devices(config.runtime.cpu_devices, config)
        from jaxpar.train import lower_step
        compiled, mesh = lower_step(config)
    except JaxparError as e:  # a mistake the user can fix (ConfigError and kin): no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    report = analyze(compiled, mesh, config.parallel.context)
    if args.json:
        print(f"xla {xla.describe()}", file=sys.stderr)  # stdout holds the JSON alone
        print(json.dumps(report.to_dict()))
        return 0
    from rich.console import Console
    console = Console(soft_wrap=True)
    if not console.is_terminal:  # piped to a file or a pager: room for the op names
        console = Console(soft_wrap=True, width=200)
    mib = {k: v / 2**20 for k, v in dataclasses.asdict(report.memory).items()}
    console.print(f"xla {xla.describe()}", highlight=False)
    console.print(f"mesh {dict(mesh.shape)}; memory per device: "
                  + ", ".join(f"{k.removesuffix('_bytes')} {v:.2f} MiB" for k, v in mib.items()))
    console.print(report.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
