"""What :func:`funcpipe.split_module` says when it cannot do what it was asked.

Messages lead with what the user did and how to fix it, name the values given, and stay short:
a cut name that is not a submodule gets the closest whole names; a forward that writes buffers
(BatchNorm in training mode) gets ``module.eval()`` first and a few of the buffers; a forward
``torch.export`` cannot follow (a shape or a branch from tensor values) gets the alternatives,
while torch's own dump of the partial graph (tens of KB on stderr) is kept from the terminal
(:func:`quiet_export`; it stays on the chained exception as ``partial_fx_graph``).
"""

from __future__ import annotations

import contextlib
import difflib
import io
import logging
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from torch import nn

from funcpipe.errors import FuncpipeError

__all__ = ["near_names", "quiet_export", "untraceable", "written_buffers"]

# the loggers torch.export's failure is reported through (besides a print of the partial graph)
_EXPORT_LOGGERS = (
    "torch.export",
    "torch._export",
    "torch._dynamo",
    "torch.fx.experimental.symbolic_shapes",
    "torch._subclasses.fake_tensor",
)


def near_names(given: str, names: Iterable[str], n: int = 3) -> list[str]:
    """The module names ``given`` (not one of them) probably meant: those it is a dotted suffix
    of (``"h.2"`` -> ``"transformer.h.2"``), then the closest whole paths (a typo)."""
    names = [m for m in names if m]
    suffix = [m for m in names if m.endswith("." + given)]
    close = difflib.get_close_matches(given, names, n=n, cutoff=0.75)
    return list(dict.fromkeys([*sorted(suffix, key=len), *close]))[:n]


@contextlib.contextmanager
def quiet_export() -> Iterator[None]:
    """Keep ``torch.export``'s own report of a failure off the terminal: its loggers are
    silenced and its print of the partial graph to ``sys.stderr`` is dropped, both restored on
    exit. The error itself (and its ``partial_fx_graph``) still propagates."""
    loggers = {logging.getLogger(name) for name in _EXPORT_LOGGERS}
    loggers |= {
        logging.getLogger(name)
        for name in list(logging.root.manager.loggerDict)
        if name.startswith(tuple(p + "." for p in _EXPORT_LOGGERS))
    }
    levels = {log: log.level for log in loggers}
    for log in loggers:
        log.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for log, level in levels.items():
            log.setLevel(level)


def _data_dependent(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        name = type(seen).__name__
        text = str(seen)
        if "DataDependent" in name or "data-dependent" in text or "data dependent" in text:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _where(e: BaseException) -> str:
    """The last source line torch.export traced before it failed (from its partial graph)."""
    graph = getattr(e, "partial_fx_graph", None)
    if not isinstance(graph, str):
        return ""
    files = [ln.strip() for ln in graph.splitlines() if ln.strip().startswith("# File: ")]
    if not files:
        return ""
    path, _, code = files[-1].removeprefix("# File: ").partition(" in ")
    func, _, line = code.partition(", code: ")
    return f"{path.rsplit('/', 1)[-1]} in {func}: {line.strip()}"


def untraceable(module: nn.Module, e: BaseException, dynamic: Any) -> FuncpipeError:
    """The error for a forward ``torch.export`` could not trace (raised ``from e``)."""
    name = type(module).__name__
    first = str(e).strip().splitlines()[0] if str(e).strip() else ""
    if _data_dependent(e):
        where = _where(e)
        moe = getattr(getattr(module, "config", None), "_experts_implementation", None)
        return FuncpipeError(
            f"split_module could not trace {name}.forward with torch.export: it makes a shape "
            "or takes a branch from tensor values (data-dependent"
            + (f", at {where}" if where else "")
            + "), e.g. torch.nonzero, boolean-mask indexing x[x > 0], `if x.sum() > 0`, or a "
            "mixture-of-experts loop over the experts hit. "
            + (
                f"{name} runs its experts with experts_implementation={moe!r}: call "
                "model.set_experts_implementation('batched_mm') (or 'grouped_mm') before "
                "split_module. Otherwise state"
                if moe == "eager"
                else "State"
            )
            + " what torch.export cannot infer with torch._check(...) in the forward, or build "
            "the stages by hand: funcpipe.from_module(...) per piece, or "
            "funcpipe.partition(nn.Sequential(...))."
        )
    return FuncpipeError(
        f"split_module could not trace {name}.forward with torch.export "
        f"({type(e).__name__}: {first}). It needs a forward whose control flow does not "
        "depend on tensor values; for transformers models pass use_cache=False in the "
        "config, and call model.eval() where it has BatchNorm (dropout may stay on). Otherwise "
        "build the stages by "
        "hand: funcpipe.from_module(...) per piece, or funcpipe.partition(nn.Sequential(...))."
        + (
            " With dynamic_shapes=, the example's size on each dim a Dim names must be 2 or "
            "more (torch.export specialises sizes 0 and 1), and its tensors their own, not "
            "views of larger ones (a slice's strides fix the sizes): example=x[:2].clone()."
            if dynamic is not None and "Constraints violated" in str(e)
            else ""
        )
    )


def _few(names: Sequence[str], n: int = 3) -> str:
    shown = ", ".join(repr(x) for x in names[:n])
    return shown + (f" and {len(names) - n} more" if len(names) > n else "")


def written_buffers(module: nn.Module, written: Sequence[str]) -> str:
    """The refusal of a forward that writes buffers or inputs in place: the fix first."""
    name = type(module).__name__
    buffers = set(dict(module.named_buffers(remove_duplicate=False)))
    if any(w in buffers for w in written):
        return (
            f"call module.eval() before split_module: {name}.forward writes {len(written)} "
            f"buffer{'s' if len(written) > 1 else ''} ({_few(written)}), as BatchNorm in training mode updates its running "
            "stats, and a stage must be a pure function. Or keep that state out of the model."
        )
    return (
        f"{name}.forward writes its inputs {_few(written)} in place, and a stage must be a pure "
        "function: compute out of place (x = x + 1, not x.add_(1))."
    )
