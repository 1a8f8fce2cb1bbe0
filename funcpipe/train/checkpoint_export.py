"""A run's checkpoint as what every other tool loads, and back: the model's parameters whole,
under the model's own names, in one safetensors file.

:func:`consolidate` reads a :func:`~funcpipe.train.checkpoint.save_model` checkpoint, saved at
any stage split, tensor layout or ZeRO level, into ``{name: full tensor}`` in this process
(no process group, no collective: call it on one rank, or after the job). :func:`export` writes
the same tensors to a ``.safetensors`` file (``funcpipe checkpoint export RUN --out FILE``); it
streams them, so it holds at most ``batch_bytes`` of them at a time. The names are the ones the
save used: for :func:`funcpipe.split_module` the module's ``state_dict`` names, so a
transformers model loads the file with ``from_pretrained`` (beside its ``config.json``) or
``load_state_dict(safetensors.torch.load_file(FILE))``. The optimizer state is not exported.

The way in is the mirror: :func:`load_safetensors` fills a run's per-stage params (at its stage
split and, through a :class:`~funcpipe.train.checkpoint.Naming`, its tensor layout) from such a
file, pretrained weights for instance, reading only the tensors this process holds, each cut to
the region it holds; ``pipe.shard`` then cuts them for ZeRO.

The safetensors layout (written here, no dependency): 8 bytes little-endian of the header's
length, the JSON header (per tensor its dtype, shape and byte range; ``__metadata__``), padded
with spaces to a multiple of 8, then every tensor's bytes in the header's order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from funcpipe.errors import InvalidArgument

__all__ = ["consolidate", "export", "load_safetensors", "read_header", "resolve"]

Tensor = torch.Tensor

_SAFETENSORS = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_PARAMS = "params/"


def resolve(run: str | os.PathLike[str]) -> str:
    """The checkpoint ``run`` names: ``run`` itself when it is one, else the newest complete
    checkpoint inside it (a run's ``--out``)."""
    from funcpipe.train import checkpoint_dirs

    path = checkpoint_dirs.check_path(run)
    if checkpoint_dirs.read_info(path) is not None:
        return path
    found = checkpoint_dirs.latest(path) if os.path.isdir(path) else None
    if found is None:
        raise InvalidArgument(
            f"{os.fspath(run)!r} is neither a complete funcpipe checkpoint nor a directory "
            "holding one (a run's --out): pass the checkpoint directory save_model wrote"
        )
    return found


def _table(path: str) -> tuple[str, dict[str, Any], Any, dict[str, dict[str, Any]]]:
    """The checkpoint's path, info, DCP metadata and ``{name: {shape, dtype}}`` of its params."""
    from funcpipe.train.checkpoint_dirs import open_checkpoint
    from funcpipe.train.checkpoint_integrity import SafeReader
    from funcpipe.train.checkpoint_named import NAMED

    source, info = open_checkpoint(path)
    if info.get("keys") != NAMED:
        raise InvalidArgument(
            f"the checkpoint {source!r} was written by checkpoint.save (keyed by pytree paths), "
            "not by save_model (keyed by the model's names): only the latter exports. Load it "
            "with checkpoint.load at its layout and write it with checkpoint.save_model"
        )
    tensors = info.get("tensors") or {}
    names = {k[len(_PARAMS) :]: v for k, v in sorted(tensors.items()) if k.startswith(_PARAMS)}
    if not names:
        raise InvalidArgument(f"the checkpoint {source!r} holds no parameters to export")
    return source, info, SafeReader(source).read_metadata(), names


def _dtype(dtype: Any) -> torch.dtype | None:
    if dtype is None or (isinstance(dtype, torch.dtype) and dtype in _SAFETENSORS):
        return dtype
    raise InvalidArgument(
        f"dtype={dtype!r}: None (each tensor as saved: the model's dtype) or a torch dtype "
        f"safetensors stores ({', '.join(str(d) for d in _SAFETENSORS)})"
    )


def _read(source: str, info: dict[str, Any], metadata: Any, want: dict[str, Any]) -> Any:
    """``{name: full tensor}`` of the params ``want`` lists (one process: no collective)."""
    from funcpipe.train.checkpoint_integrity import SafeReader, check_stored, verify
    from funcpipe.train.checkpoint_named import plan_load
    from funcpipe.train.checkpoint_write import quiet_single_process

    template = {
        name: torch.empty(v["shape"], dtype=_saved_dtype(v, None)) for name, v in want.items()
    }
    plan = plan_load(source, info, metadata, (template,), None, None)
    check_stored(source, plan.wanted, metadata)
    with quiet_single_process():
        dcp.load(plan.wanted, storage_reader=SafeReader(source), no_dist=True)
    verify(source, info, plan.wanted)
    return plan.finish(info.get("step")).params[0]


def consolidate(
    run: str | os.PathLike[str], *, dtype: torch.dtype | None = None
) -> dict[str, Tensor]:
    """The model's parameters saved in ``run`` (a checkpoint, or a directory of them: the
    newest), whole, by the model's names: ``model.load_state_dict(consolidate(run))``.
    One process, no process group; the whole model is in memory (:func:`export` streams)."""
    cast = _dtype(dtype)
    source, info, metadata, names = _table(resolve(run))
    got = _read(source, info, metadata, names)
    return {k: _cast(t, cast) for k, t in got.items()}


def _cast(t: Tensor, dtype: torch.dtype | None) -> Tensor:
    """``t`` in ``dtype`` if it is floating-point (integer and bool buffers stay as saved)."""
    return t if dtype is None or not t.is_floating_point() else t.to(dtype)


def _saved_dtype(v: dict[str, Any], dtype: torch.dtype | None) -> torch.dtype:
    saved: torch.dtype = getattr(torch, v["dtype"].removeprefix("torch."))
    return saved if dtype is None or not saved.is_floating_point else dtype


def _batches(names: dict[str, dict[str, Any]], limit: int) -> Iterator[dict[str, Any]]:
    batch: dict[str, Any] = {}
    size = 0
    for name, v in names.items():
        n = _nbytes(v)
        if batch and size + n > limit:
            yield batch
            batch, size = {}, 0
        batch[name] = v
        size += n
    if batch:
        yield batch


def _nbytes(v: dict[str, Any], dtype: torch.dtype | None = None) -> int:
    d = _saved_dtype(v, None) if dtype is None else dtype
    count = 1
    for n in v["shape"]:
        count *= n
    return count * torch.empty((), dtype=d).element_size()


def export(
    run: str | os.PathLike[str],
    out: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    batch_bytes: int = 1 << 30,
) -> dict[str, Any]:
    """Write the model's parameters saved in ``run`` (see :func:`consolidate`) to the
    safetensors file ``out``, each tensor whole, cast to ``dtype`` if given. Reads and writes
    at most ``batch_bytes`` of tensors at a time; writes ``out`` atomically (a temporary file,
    renamed). Returns what it did: ``{"checkpoint", "out", "step", "tensors", "bytes"}``."""
    cast = _dtype(dtype)
    if not isinstance(out, (str, os.PathLike)) or not os.fspath(out).endswith(".safetensors"):
        raise InvalidArgument(f"out={out!r}: a file path ending in .safetensors")
    if type(batch_bytes) is not int or batch_bytes < 1:
        raise InvalidArgument(f"batch_bytes={batch_bytes!r}: an int >= 1")
    target = os.fspath(out)
    source, info, metadata, names = _table(resolve(run))
    header: dict[str, Any] = {
        "__metadata__": {"format": "pt", "funcpipe_step": str(info.get("step"))}
    }
    offset = 0
    for name, v in names.items():
        d = _saved_dtype(v, cast)
        n = _nbytes(v, d)
        header[name] = {
            "dtype": _SAFETENSORS[d],
            "shape": v["shape"],
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    os.makedirs(os.path.dirname(target) or ".", exist_ok=True)
    tmp = f"{target}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)) + text)
            for batch in _batches(names, batch_bytes):
                got = _read(source, info, metadata, batch)
                for name in batch:
                    f.write(_raw(_cast(got[name], cast)))
                del got
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return {
        "checkpoint": source,
        "out": target,
        "step": info.get("step"),
        "tensors": len(names),
        "bytes": offset,
    }


def _raw(t: Tensor) -> Any:
    """The tensor's bytes, little-endian, in row-major order, as a buffer (no copy where the
    tensor is a contiguous CPU one already)."""
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)
    if struct.pack("=H", 1) != struct.pack("<H", 1):  # a big-endian host: swap each element
        data = data.view(-1, t.element_size()).flip(1).reshape(-1)
    return data.numpy()


# ------------------------------------------------------------------------------ the way in
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS.items()}


def read_header(file: str | os.PathLike[str]) -> tuple[int, dict[str, Any]]:
    """``(where the data starts, {name: {"dtype", "shape", "data_offsets"}})`` of a safetensors
    file (``__metadata__`` left out)."""
    try:
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100 * 2**20:
                raise ValueError(f"a header of {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error) as e:
        raise InvalidArgument(
            f"{os.fspath(file)!r} is not a readable safetensors file ({e})"
        ) from None
    if not isinstance(header, dict):
        raise InvalidArgument(f"{os.fspath(file)!r}: its safetensors header is not a JSON object")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        ok = _entry_ok(entry)
        if not ok:
            raise InvalidArgument(
                f"{os.fspath(file)!r}: the safetensors header's entry for {name!r} is not "
                f"{{dtype, shape, data_offsets}} ({entry!r:.200}); the file is damaged"
            )
    return 8 + n, header


def _entry_ok(entry: Any) -> bool:
    """Whether a safetensors header entry is ``{dtype: str, shape: [int >= 0], data_offsets:
    [a, b]}`` with ``0 <= a <= b``."""
    if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
        return False
    shape, span = entry.get("shape"), entry.get("data_offsets")
    if not isinstance(shape, list) or not all(type(k) is int and k >= 0 for k in shape):
        return False
    if not isinstance(span, list) or len(span) != 2 or not all(type(k) is int for k in span):
        return False
    return bool(0 <= span[0] <= span[1])


def _tensor(f: Any, start: int, name: str, entry: dict[str, Any], file: str) -> Tensor:
    dtype = _FROM_SAFETENSORS.get(str(entry.get("dtype")))
    a, b = entry.get("data_offsets", (0, -1))
    if dtype is None or b - a != _nbytes({"shape": entry["shape"], "dtype": str(dtype)}):
        raise InvalidArgument(
            f"{file!r}: the tensor {name!r} has a dtype or size this reader does not take ({entry})"
        )
    f.seek(start + a)
    data = bytearray(f.read(b - a))
    if len(data) != b - a:
        raise InvalidArgument(f"{file!r} is truncated: the tensor {name!r} ends past the file")
    if not data:
        return torch.empty(entry["shape"], dtype=dtype)
    flat = torch.frombuffer(data, dtype=torch.uint8)
    if struct.pack("=H", 1) != struct.pack("<H", 1):  # a big-endian host
        flat = flat.view(-1, torch.empty((), dtype=dtype).element_size()).flip(1).reshape(-1)
    return flat.view(dtype).reshape(entry["shape"])


def load_safetensors(
    file: str | os.PathLike[str], params: Any, *, naming: Any = None
) -> tuple[Any, ...]:
    """This run's per-stage params filled from the safetensors ``file`` (full tensors under the
    model's names, as :func:`export` or ``save_pretrained`` writes them).

    ``params`` is the template: per stage a pytree whose leaves give each result's shape, dtype
    and device (``None`` or meta tensors for stages this process does not hold: left as they
    are); ``naming`` (a :class:`~funcpipe.train.checkpoint.Naming`, default: each leaf whole,
    named by its path in its stage: the ``state_dict`` names of :func:`funcpipe.split_module`)
    names each leaf's tensor and the region of it this process holds. Every name the template
    asks for must be in the file with the full shape the region belongs to; the file's other
    tensors are ignored. Checked for every leaf before any is filled."""
    from funcpipe.train.checkpoint_regions import Naming, tree_paths
    from funcpipe.tree import tree_structure, tree_unflatten

    naming = naming if naming is not None else Naming()
    if not isinstance(naming, Naming):
        raise InvalidArgument(f"naming={naming!r}: a funcpipe.train.checkpoint.Naming or None")
    if not isinstance(params, tuple | list):
        raise InvalidArgument(
            f"params must be a tuple or list with one pytree per stage; got {type(params).__name__}"
        )
    source = os.fspath(file)
    start, header = read_header(source)
    jobs: list[tuple[int, str, Tensor, Any]] = []
    problems: list[str] = []
    for stage, tree in enumerate(params):
        for path, leaf in tree_paths(tree).items():
            if not isinstance(leaf, Tensor) or leaf.device.type == "meta":
                continue
            name = naming.name(stage, path)
            entry = header.get(name)
            if entry is None:
                problems.append(f"{name!r} (params[{stage}] {path!r}) is not in the file")
                continue
            region = naming.region(stage, path, tuple(leaf.shape), opt=False)
            if tuple(entry["shape"]) != region.shape or region.held_shape != tuple(leaf.shape):
                problems.append(
                    f"{name!r} is {tuple(entry['shape'])} in the file; params[{stage}] {path!r} "
                    f"holds {tuple(leaf.shape)} of a tensor {region.shape}"
                )
                continue
            jobs.append((stage, path, leaf, (name, entry, region)))
    if problems:
        more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
        raise InvalidArgument(
            f"{source!r} does not fit these params: "
            + "; ".join(problems[:8])
            + more
            + ". The names are the template's paths (split_module: the model's state_dict names) "
            "unless naming= maps them"
        )
    filled: dict[tuple[int, str], Tensor] = {}
    with open(source, "rb") as f:
        for stage, path, leaf, (name, entry, region) in jobs:
            full = _tensor(f, start, name, entry, source)
            filled[stage, path] = region.take(full).to(device=leaf.device, dtype=leaf.dtype).clone()
    out = []
    for stage, tree in enumerate(params):
        paths = tree_paths(tree)
        if not any((stage, p) in filled for p in paths):
            out.append(tree)
            continue
        leaves = [filled.get((stage, p), v) for p, v in paths.items()]
        out.append(tree_unflatten(tree_structure(tree), leaves))
    return tuple(out)
