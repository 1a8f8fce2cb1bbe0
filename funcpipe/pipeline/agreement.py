"""What the processes of one :class:`funcpipe.Pipeline` must agree on, and the checks that
they do (collectives over the world, in the same order on every process).

- :func:`program_agreement`: at construction, the same program and options (one all-gather of
  a hash);
- :func:`tie_agreement`: at the first step, every copy of a tied parameter holds one value
  (one all-gather of a fingerprint per copy);
- :func:`step_agreement`: at every step, the same shapes given, the same stage outputs
  inferred from them and the same seed (one all-gather of two fingerprints and the seed).

Each gathers texts only once the fingerprints differ, and then every process raises the same
:class:`~funcpipe.errors.InvalidArgument`, naming the processes and the difference, instead
of waiting in a collective another process never enters, or sending tensors of other shapes
than its peer receives.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from funcpipe.distributed.records import named
from funcpipe.errors import InvalidArgument
from funcpipe.schedule.ir import Program
from funcpipe.stages.boundaries import BoundarySpecs
from funcpipe.stages.shapes import TensorSpec
from funcpipe.stages.ties import resolve
from funcpipe.tree import leaf_paths, tree_flatten, tree_leaves

__all__ = [
    "TieCopy",
    "fingerprint",
    "layout_lines",
    "microbatch_prints",
    "program_agreement",
    "spec_lines",
    "step_agreement",
    "summary",
    "tie_agreement",
    "tie_copies",
    "value_fingerprint",
]

Tensor = torch.Tensor


def fingerprint(text: str) -> int:
    """A 62-bit hash of ``text`` (fits an int64 tensor on any backend)."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _gather(values: Sequence[int]) -> list[list[int]]:
    """Every process's ``values`` (int64s, as many on every process; collective over the
    world: one all-gather)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:  # no one to agree with: no collective (on NCCL, no sync)
        return [[int(v) for v in values]]
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if dist.get_backend() == "nccl"
        else torch.device("cpu")
    )
    mine = torch.tensor(list(values), dtype=torch.int64, device=device)
    every = mine.new_empty(dist.get_world_size() * len(values))
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # torch < 2.12
    try:
        gather(every, mine)
    except RuntimeError as e:  # gloo's bare report: say which rank failed, returned or timed out
        raise named(e, dist.get_rank()) from e
    return [[int(v) for v in row] for row in every.view(-1, len(values)).cpu().tolist()]


def _hashes(text: str) -> list[int]:
    """Every process's :func:`fingerprint` of its ``text`` (collective over the world)."""
    return [row[0] for row in _gather([fingerprint(text)])]


def _texts(text: Any) -> list[Any]:
    """Every process's ``text`` (collective over the world; only once the hashes differ)."""
    import torch.distributed as dist

    every: list[Any] = [None] * dist.get_world_size()
    try:
        dist.all_gather_object(every, text)
    except RuntimeError as e:
        raise named(e, dist.get_rank()) from e
    return every


def program_agreement(summary: str) -> None:
    """Every process of the world built the same program (and options): one all-gather of a
    hash; on a mismatch the summaries are gathered and compared, and every process raises
    naming the ranks that differ and the first line where they do."""
    import torch.distributed as dist

    hashes = _hashes(summary)
    if len(set(hashes)) == 1:
        return
    texts = [str(t) for t in _texts(summary)]
    me = dist.get_rank()
    ref = 0 if hashes[me] != hashes[0] else next(r for r, h in enumerate(hashes) if h != hashes[0])
    other = texts[ref]
    a, b = summary.splitlines(), str(other).splitlines()
    line = next(
        (i for i in range(max(len(a), len(b))) if (a[i : i + 1] or [""]) != (b[i : i + 1] or [""])),
        0,
    )
    differ = [r for r, h in enumerate(hashes) if h != hashes[me]]
    raise InvalidArgument(
        f"the processes built different pipelines: process {me} and process(es) {differ} "
        f"differ (every process of the world must build the same Pipeline, with the same "
        f"schedule and options). First difference, line {line + 1}: process {me} has "
        f"{(a[line : line + 1] or ['<nothing>'])[0]!r}, process {ref} has "
        f"{(b[line : line + 1] or ['<nothing>'])[0]!r}. Build the schedule from the same "
        "arguments on every process (e.g. not from the rank)"
    )


def spec_lines(tree: Any, name: str) -> list[str]:
    """One line per tensor leaf of ``tree``: its path and spec (``batch['x'] f32[8, 16]``)."""
    leaves = tree_leaves(tree)
    paths = leaf_paths(tree, name=name)
    return [
        f"{path} {TensorSpec.from_tensor(t)}" if isinstance(t, Tensor) else f"{path} {t!r}"
        for path, t in zip(paths, leaves, strict=True)
    ]


def _first_difference(a: Sequence[str], b: Sequence[str]) -> tuple[str, str]:
    """The first line where ``a`` and ``b`` differ (``<nothing>`` past the end of one)."""
    for i in range(max(len(a), len(b))):
        x = a[i] if i < len(a) else "<nothing>"
        y = b[i] if i < len(b) else "<nothing>"
        if x != y:
            return x, y
    return "<the same>", "<the same>"


def step_agreement(
    prints: Sequence[tuple[int, int]],
    error: BaseException | None,
    given: tuple[Any, Any],
    layouts: Sequence[BoundarySpecs],
    names: list[str],
    *,
    seed: int | None = None,
    explicit: bool = False,
) -> int | None:
    """Every process was given the same shapes for this step and inferred the same stage
    outputs from them, and steps with the same ``seed`` (collective over the world: every
    process calls this at every step).

    ``prints``: per microbatch, a fingerprint of its signature (its inputs, side inputs and the
    params' shapes and dtypes) and one of the stage outputs inferred from it; ``error``: this
    process's shape inference failed (it still takes part, then raises its own error);
    ``given``: the step's ``(batch, params)``, described only on a mismatch; ``layouts``: the
    microbatches' inferred outputs; ``seed``: the step's (``None`` for an eval program),
    ``explicit`` when the caller passed it. Returns the step's seed: process 0's, so every
    process draws the same masks even when their generators were seeded differently; seeds
    passed explicitly must agree. One all-gather of two fingerprints of the whole step and the
    seed; only when the fingerprints differ somewhere are the descriptions gathered too, and every process
    raises the same error: the processes given different shapes, else those whose inference
    failed, else the first stage whose outputs came out different (a stage whose output shapes
    depend on values, run on one real microbatch with zeros for what a process does not
    hold). Without it a process whose batch changed alone would wait alone in a collective (a
    hang until the deadline), or send tensors of other shapes than its peers receive; and
    processes seeded differently would draw different dropout masks, silently."""
    import torch.distributed as dist

    given_print = fingerprint(" ".join(str(g) for g, _ in prints))
    inferred = -1 if error is not None else fingerprint(" ".join(str(i) for _, i in prints))
    mine = -1 if seed is None else seed % (1 << 63)
    rows = _gather([given_print, inferred, mine, int(explicit)])
    seeds = [row[2] for row in rows]
    agreed = None if seeds[0] == -1 else seeds[0]
    if all(row[:2] == rows[0][:2] for row in rows):
        if error is not None:
            raise error
        differ = [r for r, v in enumerate(seeds) if v != seeds[0]]
        if differ and any(row[3] for row in rows):
            raise InvalidArgument(
                f"step(seed=...) differs between the processes: process 0 steps with seed "
                f"{seeds[0]}, process {differ[0]} with {seeds[differ[0]]} (process(es) {differ} "
                "differ from process 0). Every stage call runs under a random key derived from "
                "the step's seed, and the processes of one pipeline must draw the same dropout "
                "masks: pass the same seed on every process (or seed=None on all: process 0 "
                "draws it)"
            )
        return agreed
    batch, params = given
    lines = [*spec_lines(batch, "batch"), *spec_lines(params, "params")]
    described = [layout_lines(layout) for layout in layouts] if error is None else None
    texts = _texts((lines, described))  # every process takes part
    givens = [row[0] for row in rows]
    if len(set(givens)) > 1:
        differ = [r for r, h in enumerate(givens) if h != givens[0]]
        a, b = _first_difference(texts[0][0], texts[differ[0]][0])
        what = "params" if a.startswith("params") or b.startswith("params") else "batches"
        fix = (
            "Give every process the params of every stage in the same shapes and dtypes (a "
            "stage it does not hold may be meta tensors of those shapes and dtypes)"
            if what == "params"
            else "Give every process a batch of the same shapes at each step: pad sequences "
            "to one length, and give data-parallel copies equal shares (drop or pad a last, "
            "smaller batch)"
        )
        raise InvalidArgument(
            f"the processes were given {what} of different shapes or dtypes: process 0 has "
            f"{a}, process {differ[0]} has {b} (process(es) {differ} differ from process 0 at "
            "this step). Every process of the world steps with a batch and params of the same "
            "shapes and dtypes: each one infers every stage's shapes from its own, and what it "
            f"sends and receives follows from them. {fix}"
        )
    if error is not None:
        raise error
    failed = [r for r, row in enumerate(rows) if row[1] == -1]
    if failed:
        raise InvalidArgument(
            f"shape inference failed on process(es) {failed} (their errors say why); this "
            "process stops too instead of waiting for them"
        )
    me = dist.get_rank()
    ref = next(r for r, row in enumerate(rows) if row[1] != rows[me][1])
    mine, other = texts[me][1], texts[ref][1]
    j = next((j for j, (a, b) in enumerate(zip(mine, other, strict=False)) if a != b), 0)
    lines_a, lines_b = mine[j], other[j]
    k = next((i for i, (a, b) in enumerate(zip(lines_a, lines_b, strict=False)) if a != b), 0)
    raise InvalidArgument(
        f"the processes inferred different outputs for stage {k} ({names[k]!r}): process {me} "
        f"has {lines_a[k]}, process {ref} has {lines_b[k]}. That stage's output shapes depend on "
        "values (it cannot run on tensors without data, so each process ran it on one real "
        "microbatch, with zeros for the parameters and inputs it does not hold). Make its "
        "output shapes follow from its input shapes alone (e.g. pad to a fixed length), or "
        "compute the value-dependent part outside the pipeline"
    )


def value_fingerprint(t: Tensor) -> int:
    """A 62-bit hash of a tensor's dtype, shape and bytes, computed where the tensor is (its
    bytes as int64 words: their sum and a position-weighted sum, wrapping, so the same on any
    device and in any reduction order), then read once."""
    if t.layout is not torch.strided:  # (no bytes to read: its dtype and shape only)
        return fingerprint(f"{t.dtype} {tuple(t.shape)} {t.layout}")
    flat = t.detach().reshape(-1).contiguous()
    raw = flat.view(torch.uint8) if flat.numel() else flat.new_empty(0, dtype=torch.uint8)
    whole = raw.numel() // 8 * 8
    words = raw[:whole].view(torch.int64)
    sums = torch.zeros(2, dtype=torch.int64, device=raw.device)
    chunk = 1 << 22  # words at a time: the weights of one chunk are 32 MiB
    for lo in range(0, words.numel(), chunk):
        w = words[lo : lo + chunk]
        weights = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=w.device) * 2 + 1
        sums[0] += w.sum()
        sums[1] += (w * weights).sum()
    tail = raw[whole:].to(torch.int64)
    sums[1] += (tail * torch.arange(1, tail.numel() + 1, device=tail.device)).sum()
    s1, s2 = sums.tolist()
    return fingerprint(f"{t.dtype} {tuple(t.shape)} {s1} {s2}")


TieCopy = tuple[str, int, Any, Tensor | None]  # (tie, stage, path, this process's copy or None)


def tie_agreement(copies: Sequence[TieCopy], tensor: int) -> None:
    """Every copy of each tied parameter holds the same value on every process (collective
    over the world; every process calls it once, at a Pipeline's first step).

    ``copies``: every member of every tie, in one order on every process, with this process's
    copy where it runs the member's stage (else ``None``). Over processes each stage computes
    with the copy its own process holds: copies that differ (each process seeded its own)
    would train as different values under one summed gradient, silently. One all-gather of a
    fingerprint per member (:func:`value_fingerprint`); copies are compared between processes
    of one tensor-parallel coordinate (world rank modulo ``tensor``), which hold the same
    shard. On a mismatch every process raises naming the tie, both copies and their
    processes."""
    if not copies:
        return
    mine = [-1 if t is None or t.is_meta else value_fingerprint(t) for *_, t in copies]
    rows = _gather(mine)
    bad: tuple[str, list[tuple[int, int]]] | None = None
    for name in dict.fromkeys(c[0] for c in copies):
        index = [i for i, c in enumerate(copies) if c[0] == name]
        for coord in range(tensor):
            held = [
                (i, g) for i in index for g in range(coord, len(rows), tensor) if rows[g][i] != -1
            ]
            if len({rows[g][i] for i, g in held}) > 1:
                bad = (name, held)
                break
        if bad is not None:
            break
    if bad is None:
        return
    specs = _texts([None if t is None else repr(TensorSpec.from_tensor(t)) for *_, t in copies])
    name, held = bad
    i0, g0 = held[0]  # the first listed copy held anywhere
    i1, g1 = next((i, g) for i, g in held if rows[g][i] != rows[g0][i0])
    (_, s0, p0, _), (_, s1, p1, _) = copies[i0], copies[i1]
    spec0, spec1 = specs[g0][i0], specs[g1][i1]
    if spec0 != spec1:
        raise InvalidArgument(
            f"ties[{name!r}]: the tied copies have different shapes or dtypes: stage {s0} "
            f"{p0!r} is {spec0} on process {g0}, stage {s1} {p1!r} is {spec1} on process "
            f"{g1}; tied parameters must have one shape and dtype"
        )
    raise InvalidArgument(
        f"ties[{name!r}]: the tied copies hold different values: stage {s0} {p0!r} on process "
        f"{g0} and stage {s1} {p1!r} on process {g1} ({spec0} each). Over processes each stage "
        "computes with the copy its own process holds (only in one process is the first listed "
        "value used for all), so the tie would train different values with one summed "
        "gradient (silently wrong). Give every copy the same value before the first step: "
        "make them from one seed on every process, or copy the first listed value into the "
        "others (e.g. load the same checkpoint everywhere)"
    )


def microbatch_prints(key: Any, layout: BoundarySpecs | None) -> tuple[int, int]:
    """A microbatch's fingerprints for :func:`step_agreement`: of its signature ``key`` (a
    pytree's structure, shapes and dtypes: the same text on every process) and of the stage
    outputs inferred from it (0 where inference failed)."""
    inferred = 0 if layout is None else fingerprint("\n".join(layout_lines(layout)))
    return fingerprint(repr(key)), inferred


def layout_lines(layout: BoundarySpecs) -> list[str]:
    """One line per stage of an inferred layout (what the processes compare)."""
    return [
        f"{', '.join(str(leaf) for leaf in spec.leaves)} as {spec.tree}"
        f"{f'; no gradient for {sorted(spec.nograd)}' if spec.nograd else ''}"
        for s, spec in sorted(layout.items())
    ]


def tie_copies(
    program: Program, rank: int, ties: dict[str, list[Any]], params: Sequence[Any]
) -> list[TieCopy]:
    """Every member of every tie (in name order), with this program rank's copy where it runs
    the member's stage: what :func:`tie_agreement` compares."""
    owners = program.replica_of or tuple(range(program.n_stages))
    held = {owners[s] for s in program.stages_on(rank)}
    copies: list[TieCopy] = []
    for name in sorted(ties):
        for s, path in ties[name]:
            t = None
            if s in held:
                leaves, _ = tree_flatten(params[s])
                t = leaves[resolve(params[s], path, f"ties[{name!r}]")]
            copies.append((name, s, path, t))
    return copies


def summary(pipe: Any, mesh: Any) -> str:
    """What every process of a Pipeline must agree on (:func:`program_agreement`): the options
    that shape the step, then the lowered program's text."""
    sizes: tuple[int, ...] | None = None
    if mesh is not None:
        c = mesh.config
        sizes = (c.pipeline, c.data, c.tensor) + ((c.expert,) if c.expert > 1 else ())
    head = [
        f"stages {len(pipe.stages)}",  # not their names: a rank may hold only its own
        f"loss_fn {pipe.loss_fn is not None} metric_fn {pipe.metric_fn is not None}",
        f"ties {sorted((k, repr(v)) for k, v in pipe.ties.items())}",
        f"side_inputs {sorted(pipe.side_inputs.items())}",
        f"experts {sorted((s, repr(p)) for s, p in pipe.experts)}",
        f"recompute {sorted(pipe.recompute)} grad_dtype {pipe.grad_dtype}",
        f"mesh {sizes} scatter_gather {pipe.scatter_gather} dim {pipe.dim!r}",
    ]
    return "\n".join([*head, pipe.program.to_text()])
