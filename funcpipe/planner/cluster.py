"""What a GPU cluster is to the planner: chips, nodes and the links between them.

All figures are editable dataclasses; the presets hold datasheet numbers (dense, no sparsity;
the H100s and the H200 also have an ``fp8`` peak, twice their bf16 one: 1,979 TF/s SXM,
1,513 PCIe; the A100 has none):

=============  ==========  ========  ===========  ==============  =====================
preset         bf16 peak   memory    HBM          NVLink per GPU  inter-node per GPU
=============  ==========  ========  ===========  ==============  =====================
``a100-40gb``  312 TF/s    40 GB     1.555 TB/s   300 GB/s        25 GB/s (HDR 200 Gb/s)
``a100-80gb``  312 TF/s    80 GB     2.039 TB/s   300 GB/s        25 GB/s (HDR 200 Gb/s)
``h100-sxm``   989 TF/s    80 GB     3.35 TB/s    450 GB/s        50 GB/s (NDR 400 Gb/s)
``h100-pcie``  756 TF/s    80 GB     2.0 TB/s     300 GB/s (bridge) 50 GB/s (NDR 400 Gb/s)
``h200``       989 TF/s    141 GB    4.8 TB/s     450 GB/s        50 GB/s (NDR 400 Gb/s)
=============  ==========  ========  ===========  ==============  =====================

NVLink figures are one direction (the A100's 600 GB/s and the H100's 900 GB/s datasheet figures
count both directions); a ring moves data one way per step, so these are what a ring sees.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from funcpipe.errors import InvalidArgument

__all__ = ["GPU", "GPUS", "Cluster", "Link", "cluster"]


@dataclass(frozen=True)
class GPU:
    """One chip: ``flops`` dense peak FLOP/s per dtype (``"bf16"``, ``"fp16"``, ``"fp32"``,
    ``"tf32"``, ``"fp8"`` where the chip has FP8 tensor cores), ``memory`` bytes, ``bandwidth``
    bytes/s of its memory."""

    name: str
    flops: dict[str, float]
    memory: float
    bandwidth: float

    def peak(self, dtype: str) -> float:
        if dtype not in self.flops:
            raise InvalidArgument(
                f"GPU {self.name!r}: dtype={dtype!r} has no peak; the dtypes are "
                f"{', '.join(sorted(self.flops))}"
            )
        return self.flops[dtype]


@dataclass(frozen=True)
class Link:
    """A link one GPU sees: ``bandwidth`` bytes/s one way, ``latency`` seconds per message."""

    bandwidth: float
    latency: float


@dataclass(frozen=True)
class Cluster:
    """``gpus_per_node`` chips joined by ``intra`` (NVLink), nodes joined by ``inter``
    (InfiniBand: one NIC per GPU). Mesh axes map onto ranks with ``tensor`` innermost, then
    ``data``, then ``pipeline`` (Megatron's order): an axis whose group fits in a node uses
    ``intra``, one that spans nodes uses ``inter``."""

    gpu: GPU
    gpus_per_node: int = 8
    intra: Link = Link(300e9, 3e-6)
    inter: Link = Link(25e9, 10e-6)

    def link(self, *, stride: int, size: int) -> Link:
        """The link of an axis whose ``size`` members are ``stride`` ranks apart."""
        return self.intra if stride * size <= self.gpus_per_node else self.inter


_A100 = {"bf16": 312e12, "fp16": 312e12, "tf32": 156e12, "fp32": 19.5e12}
_H100_SXM = {"bf16": 989e12, "fp16": 989e12, "fp8": 1979e12, "tf32": 494e12, "fp32": 67e12}
_H100_PCIE = {"bf16": 756e12, "fp16": 756e12, "fp8": 1513e12, "tf32": 378e12, "fp32": 51e12}
GB = 1e9

GPUS: dict[str, Cluster] = {
    "a100-40gb": Cluster(GPU("A100-SXM4-40GB", _A100, 40 * GB, 1.555e12)),
    "a100-80gb": Cluster(GPU("A100-SXM4-80GB", _A100, 80 * GB, 2.039e12)),
    "h100-sxm": Cluster(
        GPU("H100-SXM5-80GB", _H100_SXM, 80 * GB, 3.35e12),
        intra=Link(450e9, 3e-6),
        inter=Link(50e9, 8e-6),
    ),
    "h100-pcie": Cluster(
        GPU("H100-PCIe-80GB", _H100_PCIE, 80 * GB, 2.0e12),
        intra=Link(300e9, 5e-6),
        inter=Link(50e9, 8e-6),
    ),
    "h200": Cluster(
        GPU("H200-SXM-141GB", _H100_SXM, 141 * GB, 4.8e12),
        intra=Link(450e9, 3e-6),
        inter=Link(50e9, 8e-6),
    ),
}
"""The presets by name; ``dataclasses.replace`` one to edit it (``cluster(..., **changes)``)."""


def cluster(name: str | Cluster, **changes: object) -> Cluster:
    """The preset ``name`` (or a :class:`Cluster` as is), with ``changes`` applied."""
    if isinstance(name, Cluster):
        base = name
    else:
        key = name.strip().lower() if isinstance(name, str) else ""
        if key not in GPUS:
            raise InvalidArgument(
                f"gpu={name!r} is not a preset; the presets are {', '.join(GPUS)} "
                "(or pass a funcpipe.planner.Cluster)"
            )
        base = GPUS[key]
    return replace(base, **changes) if changes else base  # type: ignore[arg-type]
