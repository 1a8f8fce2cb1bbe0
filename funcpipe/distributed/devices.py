"""Which backend a launched job uses, and which device each of its ranks computes on.

One rule for every rank, whoever starts it (:func:`funcpipe.launch`, :class:`funcpipe.Pool` or
``torchrun``): the backend is NCCL when CUDA is available and gloo otherwise
(:func:`default_backend`), an explicit one is respected; a gloo rank computes on the CPU, an NCCL
rank on the GPU of its local rank (:func:`rank_device`), made current before its process group
starts (:func:`claim_device`). More ranks on a host than GPUs is an
:class:`~funcpipe.errors.InvalidArgument` before any process starts (:func:`choose_backend`),
unless sharing is asked for (``share_gpus=True`` or ``FUNCPIPE_SHARE_GPUS=1``: :func:`sharing`).
"""

from __future__ import annotations

import inspect
import os
from typing import TYPE_CHECKING, Any

from funcpipe.errors import InvalidArgument, check_int

if TYPE_CHECKING:
    import torch

__all__ = [
    "BACKENDS",
    "NCCL_ENV",
    "SHARE_ENV",
    "check_backend",
    "choose_backend",
    "claim_device",
    "default_backend",
    "device_id",
    "rank_device",
    "sharing",
]

SHARE_ENV = "FUNCPIPE_SHARE_GPUS"  # "1": NCCL ranks may share GPUs when they outnumber them
BACKENDS = ("gloo", "nccl")
# Set in NCCL ranks unless the environment already says otherwise (read when the group starts):
NCCL_ENV = {
    # An NCCL error or timeout seen by the watchdog tears the process down (torch's default since
    # 2.2, pinned here): a rank never lingers blocked on a dead peer, and the launcher (or
    # torchrun) sees it exit. TORCH_NCCL_BLOCKING_WAIT is left off: it would make every wait()
    # block the CPU until the GPU finished the operation, serialising compute and communication.
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",
}


def default_backend() -> str:
    """``"nccl"`` when CUDA is available, else ``"gloo"``: what :func:`~funcpipe.distributed.launcher.launch` uses by default."""
    import torch

    return "nccl" if torch.cuda.is_available() else "gloo"


def sharing(share_gpus: bool | None) -> bool:
    """Whether ranks may share GPUs: ``share_gpus``, or for ``None`` whether
    ``FUNCPIPE_SHARE_GPUS`` is ``1``, ``true`` or ``yes``."""
    if share_gpus is not None and not isinstance(share_gpus, bool):
        raise InvalidArgument(
            f"share_gpus={share_gpus!r}: True lets NCCL ranks share GPUs when they outnumber "
            f"them; False forbids it; None reads {SHARE_ENV} from the environment"
        )
    if share_gpus is not None:
        return share_gpus
    return os.environ.get(SHARE_ENV, "").strip().lower() in ("1", "true", "yes")


def rank_device(local_rank: int, backend: str, *, share: bool = False) -> torch.device:
    """The device of the rank that is number ``local_rank`` among the ranks of its host.

    A gloo rank computes on the CPU: ``cpu``. An NCCL rank gets a GPU of its own:
    ``cuda:<local_rank>`` (of the devices ``CUDA_VISIBLE_DEVICES`` leaves visible). A local rank
    with no GPU of its own is an :class:`InvalidArgument`, unless ``share`` is true: ranks then
    wrap around, ``cuda:<local_rank % device_count>``. (NCCL 2.5 and later refuses two ranks of
    one process group on one GPU, "Duplicate GPU detected", so sharing is an explicit choice for
    setups that allow it, never a silent fallback.) ``backend="nccl"`` without CUDA is an
    :class:`InvalidArgument` too.
    """
    import torch

    check_int("local_rank", local_rank, 0, "this rank's index on its host, >= 0")
    check_backend(backend)
    if backend == "gloo":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank < count:
        return torch.device("cuda", local_rank)
    if share:
        return torch.device("cuda", local_rank % count)
    raise InvalidArgument(
        f"local rank {local_rank} has no GPU of its own: {_gpus(count)}. " + _outnumber_fix(count)
    )


def check_backend(backend: str) -> None:
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend={backend!r}: use 'gloo' (CPU) or 'nccl' (CUDA)")
    if backend == "nccl":
        import torch

        if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
            raise InvalidArgument(
                "backend='nccl' needs CUDA, but torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use backend='gloo' for CPU "
                "ranks, or leave backend unset (NCCL when CUDA is available, else gloo)"
            )


def _gpus(count: int) -> str:
    """``this host has 2 CUDA devices (cuda:0, cuda:1)``."""
    names = ", ".join(f"cuda:{i}" for i in range(count))
    return f"this host has {count} CUDA device{'s' if count != 1 else ''} ({names})"


def _outnumber_fix(count: int) -> str:
    return (
        f"NCCL ranks get one GPU each: start at most {count} rank{'s' if count != 1 else ''} per "
        f"host (torchrun --nproc-per-node {count}), use backend='gloo' for CPU ranks, or opt in "
        f"to sharing with share_gpus=True or {SHARE_ENV}=1 in the environment (local rank r "
        f"then uses cuda:r % {count}; NCCL itself refuses two ranks of one group on one GPU)"
    )


def choose_backend(backend: str | None, ranks_here: int | None, *, share: bool) -> str:
    """The backend for ``ranks_here`` ranks on this host (``None``: unknown), checked against
    this host's GPUs before any process starts; ``backend=None`` means :func:`default_backend`."""
    chosen = default_backend() if backend is None else backend
    check_backend(chosen)
    if chosen == "nccl" and ranks_here is not None and not share:
        import torch

        count = torch.cuda.device_count()
        if ranks_here > count:
            raise InvalidArgument(
                f"{ranks_here} ranks on this host (local ranks 0..{ranks_here - 1}) but "
                f"{_gpus(count)}. " + _outnumber_fix(count)
            )
    return chosen


def claim_device(local_rank: int, backend: str, *, share: bool) -> torch.device:
    """This process's device (:func:`rank_device`), made current before its group starts."""
    import torch

    device = rank_device(local_rank, backend, share=share)
    if device.type == "cuda":
        for name, value in NCCL_ENV.items():
            os.environ.setdefault(name, value)
        torch.cuda.set_device(device)
    return device


def device_id(device: torch.device) -> dict[str, Any]:
    """``{"device_id": device}`` for ``init_process_group`` where torch takes it (2.3 and later):
    the NCCL communicator then starts at once, bound to this rank's GPU."""
    if device.type != "cuda":
        return {}
    import torch.distributed as dist

    try:
        params = inspect.signature(dist.init_process_group).parameters
    except (TypeError, ValueError):
        return {}
    return {"device_id": device} if "device_id" in params else {}
