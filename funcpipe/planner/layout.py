"""A parallel layout: how a training step is cut over GPUs and time."""

from __future__ import annotations

from dataclasses import InitVar, asdict, dataclass

from funcpipe.errors import InvalidArgument

__all__ = [
    "DISPATCHERS",
    "MAX_GPUS",
    "MAX_STAGES",
    "MOE_TENSOR",
    "PAIRING",
    "RECOMPUTE",
    "SCHEDULES",
    "ZERO",
    "ClusterLayout",
    "check_gpus",
]

RECOMPUTE = ("none", "selective", "full")
SCHEDULES = ("1f1b", "interleaved", "gpipe", "zb-h1", "zb-h2", "zbv", "dualpipev")
"""Schedules the planner prices (names of :data:`funcpipe.schedule.GENERATORS`)."""

MOE_TENSOR = ("width", "tokens")
"""How an MoE block uses a tensor axis (``ClusterLayout(moe_tensor=)``)."""

PAIRING = ("zbv", "dualpipev")
"""Schedules whose generators pair a forward with a backward (``overlap=True``: overlapped pairs,
:mod:`funcpipe.schedule.pairs`), so a layout may hide its expert all-to-all in them
(``ClusterLayout(overlap=True)``)."""

ZERO = (0, 1, 2)
"""Sharding levels over ``data`` the planner prices (``Pipeline(zero=...)``): 0 none; 1 (ZeRO-1)
parameters and optimizer state kept 1/d between steps, the step's gradient sums whole until one
reduce-scatter per stage; 2 (ZeRO-2) as 1, but a reduce-scatter per stage and microbatch into a
1/d gradient shard, so only one chunk's full gradient exists at a time."""

DISPATCHERS = ("alltoall", "hybridep")
"""How a mixture of experts' tokens cross the ``expert`` axis (Megatron-Core's dispatchers):
``alltoall`` a flat NCCL all-to-all, every routed copy sent to its expert's rank;
``hybridep`` DeepEP's Hybrid-EP (Megatron-Core's ``flex`` dispatcher with
``moe_flex_dispatcher_backend="hybridep"``), which sends a token over the network once per
other node holding any of its experts and fans it out over NVLink there
(:func:`funcpipe.planner.moe.dispatch_seconds`)."""

_CHUNKS = {"1f1b": 1, "gpipe": 1, "zb-h1": 1, "zb-h2": 1, "zbv": 2, "dualpipev": 2}

MAX_GPUS = 2**20
"""The most GPUs the planner models: 1,048,576, several times the largest clusters trained on
(of the order of 100,000 GPUs). Its cluster model (one flat inter-node link) was never meant for
more, and the search's work grows with the GPU count; a larger count is refused, saying so
(issue 42: 10**9 GPUs gave no answer in 150 s)."""

MAX_STAGES = 1024
"""The most pipeline stages (pipeline x interleave) the planner models: the longest pipelines in
use have about a hundred. A layout's price is computed stage by stage, and the search does not
consider more; a given layout with more is refused (issue 42: 10**7 stages never answered)."""


def check_gpus(gpus: int, where: str) -> None:
    """Refuse a GPU count beyond :data:`MAX_GPUS`, naming it."""
    if gpus > MAX_GPUS:
        raise InvalidArgument(
            f"{where}(gpus={gpus}): the planner models clusters of up to {MAX_GPUS:,} GPUs "
            "(2**20, several times the largest trained on); plan for at most that many"
        )


@dataclass(frozen=True)
class ClusterLayout:
    """``tensor`` x ``pipeline`` x ``data`` GPUs; ``microbatch`` sequences per microbatch;
    ``interleave`` stages (chunks) per pipeline rank; ``recompute`` one of
    :data:`RECOMPUTE`; ``sequence_parallel`` shards norms and dropout over the tensor axis;
    ``schedule`` one of :data:`SCHEDULES`; ``zero`` one of :data:`ZERO`, the sharding over
    ``data`` (``zero1=True`` is the old spelling of ``zero=1``; after construction ``zero1`` says
    whether the optimizer state is sharded, ``zero >= 1``);
    ``stage_layers`` the blocks of each of the ``pipeline x interleave`` stages in order (default
    an even split), e.g. one block fewer on the first and last stage for the embedding and the
    output layer, as Megatron-LM's ``--decoder-first/last-pipeline-num-layers`` do;
    ``expert`` the expert-parallel size: a mixture of experts' experts split over ``expert`` of
    the ``data`` copies (Megatron-Core folds expert parallelism into data parallelism: the GPUs
    are still tensor x pipeline x data, ``expert`` divides ``data``; dense gradients are reduced
    over all ``data`` copies, expert gradients over the ``data / expert`` holding the same
    experts); ``dispatcher`` one of :data:`DISPATCHERS`, how the expert axis moves tokens;
    ``overlap`` runs the schedule's overlapped pairs (a forward beside another microbatch's
    backward, each hiding its expert all-to-all behind the other's compute): only with an
    expert axis and a schedule of :data:`PAIRING`; ``moe_tensor`` one of :data:`MOE_TENSOR`,
    how an MoE block uses ``tensor > 1``: each expert's width split over it (``"width"``), or
    its tokens, the experts spread over the ``expert x tensor`` ranks (``"tokens"``; funcpipe's
    ``GPTConfig(moe_tensor=)``, docs/moe.md)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1
    microbatch: int = 1
    interleave: int = 1
    recompute: str = "none"
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    zero1: InitVar[bool] = False  # (read back as the property below)
    stage_layers: tuple[int, ...] | None = None
    zero: int = -1  # -1: not given (0, or 1 with zero1=True); always 0, 1 or 2 once made
    expert: int = 1
    dispatcher: str = "alltoall"
    overlap: bool = False
    moe_tensor: str = "width"

    def __post_init__(self, zero1: bool) -> None:
        for name in ("tensor", "pipeline", "data", "microbatch", "interleave", "expert"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidArgument(f"ClusterLayout({name}={value!r}): a positive integer")
        self._check_zero(zero1)
        if self.data % self.expert:
            raise InvalidArgument(
                f"ClusterLayout(expert={self.expert}, data={self.data}): the expert axis spans "
                "expert of the data-parallel copies (expert parallelism folded into data "
                "parallelism, as Megatron-Core does), so expert must divide data; pick an expert "
                f"size out of the divisors of {self.data}, or more data copies"
            )
        self._check_dispatcher()
        if self.recompute not in RECOMPUTE:
            raise InvalidArgument(
                f"ClusterLayout(recompute={self.recompute!r}): one of {', '.join(RECOMPUTE)}"
            )
        if self.schedule not in SCHEDULES:
            raise InvalidArgument(
                f"ClusterLayout(schedule={self.schedule!r}): one of {', '.join(SCHEDULES)}"
            )
        self._check_overlap()
        if self.moe_tensor not in MOE_TENSOR:
            raise InvalidArgument(
                f"ClusterLayout(moe_tensor={self.moe_tensor!r}): one of {', '.join(MOE_TENSOR)}"
            )
        if self.moe_tensor == "tokens" and self.tensor == 1:
            raise InvalidArgument(
                "ClusterLayout(moe_tensor='tokens', tensor=1): the tokens are split over the "
                "tensor ranks, and there is one; pass tensor > 1 or leave it out"
            )
        if self.moe_tensor == "tokens" and self.sequence_parallel:
            raise InvalidArgument(
                "ClusterLayout(moe_tensor='tokens', sequence_parallel=True): the tokens split "
                "is priced as funcpipe runs it, between blocks whose activations every tensor "
                "rank holds whole; for Megatron's sequence-parallel MoE pass "
                "moe_tensor='width' with sequence_parallel=True"
            )
        fixed = _CHUNKS.get(self.schedule)
        if fixed is not None and self.interleave != fixed:
            raise InvalidArgument(
                f"ClusterLayout(schedule={self.schedule!r}, interleave={self.interleave}): that "
                f"schedule runs {fixed} stage(s) per rank; pass interleave={fixed} or "
                "schedule='interleaved'"
            )
        if self.schedule == "interleaved" and self.interleave < 2:
            raise InvalidArgument(
                "ClusterLayout(schedule='interleaved', interleave=1): interleaving needs interleave >= 2"
            )
        if self.stage_layers is not None:
            counts = self.stage_layers
            stages = self.pipeline * self.interleave
            if (
                isinstance(counts, (str, bytes))
                or not hasattr(counts, "__len__")
                or not all(isinstance(n, int) and not isinstance(n, bool) for n in counts)
                or any(n < 0 for n in counts)
                or len(counts) != stages
                or not any(counts)
            ):
                raise InvalidArgument(
                    f"ClusterLayout(stage_layers={counts!r}): give one block count (an integer >= 0) "
                    f"per stage, pipeline x interleave = {stages} of them, not all zero"
                )
            object.__setattr__(self, "stage_layers", tuple(counts))
        if self.sequence_parallel and self.tensor == 1:
            raise InvalidArgument(
                "ClusterLayout(sequence_parallel=True, tensor=1): sequence parallelism shards over "
                "the tensor axis; pass tensor > 1 or leave it off"
            )

    def _check_dispatcher(self) -> None:
        if self.dispatcher not in DISPATCHERS:
            raise InvalidArgument(
                f"ClusterLayout(dispatcher={self.dispatcher!r}): one of {', '.join(DISPATCHERS)}"
            )
        if self.dispatcher != "alltoall" and self.expert == 1:
            raise InvalidArgument(
                f"ClusterLayout(dispatcher={self.dispatcher!r}, expert=1): a dispatcher moves "
                "tokens over the expert axis, and there is none; pass expert > 1 or leave it out"
            )

    def _check_overlap(self) -> None:
        if not isinstance(self.overlap, bool):
            raise InvalidArgument(f"ClusterLayout(overlap={self.overlap!r}): True or False")
        if not self.overlap:
            return
        if self.schedule not in PAIRING:
            raise InvalidArgument(
                f"ClusterLayout(overlap=True, schedule={self.schedule!r}): overlapped pairs "
                f"are priced on the schedules whose generators pair ({', '.join(PAIRING)}); "
                "pass schedule='dualpipev' or 'zbv' (interleave=2), or overlap=False"
            )
        if self.expert == 1:
            raise InvalidArgument(
                "ClusterLayout(overlap=True, expert=1): an overlapped pair hides the expert "
                "all-to-all, and there is no expert axis; pass expert > 1 (a mixture of "
                "experts) or overlap=False"
            )
        if self.pipeline == 1:
            raise InvalidArgument(
                "ClusterLayout(overlap=True, pipeline=1): overlapped pairs are priced by "
                "simulating the pipeline's program, and one stage has none to price; pass "
                "pipeline > 1 or overlap=False"
            )

    def _check_zero(self, zero1: bool) -> None:
        """``zero`` one of :data:`ZERO`; ``zero1=True`` (the old spelling) means 1 where ``zero``
        is not given, and is refused beside ``zero=0``: ``dataclasses.replace(layout, zero=0)``
        on a sharded layout passes its ``zero1`` (True) again, and that must not leave it
        sharded without a word."""
        zero = self.zero
        if zero1 not in (False, True):
            raise InvalidArgument(
                f"ClusterLayout(zero1={zero1!r}): True or False (or use zero=0, 1 or 2)"
            )
        if zero == -1:
            zero = 1 if zero1 else 0
        elif zero1 and zero == 0:
            raise InvalidArgument(
                "ClusterLayout(zero=0, zero1=True): the two disagree (zero1=True is the old "
                "spelling of zero=1). With dataclasses.replace, which passes the layout's zero "
                "and zero1 again: to shard, pass zero=1 (replace(layout, zero=1)); to unshard, "
                "pass zero1=False too (replace(layout, zero=0, zero1=False))"
            )
        if isinstance(zero, bool) or zero not in ZERO:
            raise InvalidArgument(
                f"ClusterLayout(zero={zero!r}): 0 (no sharding), 1 (ZeRO-1: optimizer state and "
                "parameters sharded over data) or 2 (ZeRO-2: gradients too, reduce-scattered "
                "every microbatch)"
            )
        object.__setattr__(self, "zero", zero)
        if zero and self.data == 1:
            raise InvalidArgument(
                f"ClusterLayout(zero={zero}, data=1): ZeRO shards over the data-parallel copies, "
                "and there is one; pass data > 1 or zero=0"
            )

    @property
    def gpus(self) -> int:
        return self.tensor * self.pipeline * self.data

    def as_dict(self) -> dict[str, object]:
        """The fields (and ``zero1``); ``expert`` only where the layout has an expert axis,
        ``dispatcher`` only where it is not ``alltoall`` and ``overlap`` only where it is on, so
        a dense layout's JSON is what it was before the axis came in."""
        out = {**asdict(self), "zero1": self.zero >= 1}
        if self.expert == 1:
            del out["expert"]
        if self.dispatcher == "alltoall":
            del out["dispatcher"]
        if not self.overlap:
            del out["overlap"]
        if self.moe_tensor == "width":
            del out["moe_tensor"]
        return out

    def short(self) -> str:
        """``t8 p8 d24 b1 v2 full sp interleaved``-style text (``e8`` after ``d`` for an expert
        axis, ``hybridep`` before the schedule for that dispatcher, ``overlap`` before it for
        overlapped pairs)."""
        bits = [
            f"t{self.tensor}",
            f"p{self.pipeline}",
            f"d{self.data}",
            *([f"e{self.expert}"] if self.expert > 1 else []),
            f"b{self.microbatch}",
            f"v{self.interleave}",
            self.recompute,
        ]
        if self.sequence_parallel:
            bits.append("sp")
        if self.zero:
            bits.append(f"zero{self.zero}")
        if self.stage_layers is not None:
            bits.append("layers " + ",".join(map(str, self.stage_layers)))
        if self.dispatcher != "alltoall":
            bits.append(self.dispatcher)
        if self.moe_tensor == "tokens":
            bits.append("moe-tokens")
        if self.overlap:
            bits.append("overlap")
        bits.append(self.schedule)
        return " ".join(bits)


# after the class is made: a property in the class body would be taken for the InitVar's default
setattr(  # noqa: B010 (the InitVar's name, for readers of the old spelling)
    ClusterLayout,
    "zero1",
    property(
        lambda self: self.zero >= 1,
        doc="Whether the optimizer state is sharded (``zero >= 1``; the old spelling).",
    ),
)
