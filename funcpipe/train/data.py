"""A byte-level text corpus that needs no download, and a deterministic batch loader.

:func:`load_corpus` reads Python source files of the standard library that ships with the
interpreter (``sysconfig.get_paths()["stdlib"]``): a seeded, deterministic choice of files up to
a size cap, concatenated in path order. Without the stdlib sources (an embedded Python with only
``.pyc`` files) it falls back to generated text. Tokens are bytes (``vocab_size = 256``); the last
``val_fraction`` of the bytes is the validation split.

Batches are a pure function of ``(split, step, seed)`` (see :meth:`Corpus.get_batch`), so a
resumed run sees exactly the batches the uninterrupted run would have seen.

The corpus depends on the Python version (the stdlib changes between releases);
``Corpus.fingerprint`` identifies the bytes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import random
import sysconfig
from collections.abc import Iterator

import torch

from funcpipe.errors import InvalidArgument, check_int

__all__ = ["Corpus", "load_corpus"]

Tensor = torch.Tensor
SPLITS = ("train", "val")
# Directories of the stdlib left out: installed packages (they depend on the machine), caches,
# and the test suites (large data tables and deliberately odd files).
_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)


@functools.lru_cache(maxsize=4)
def _stdlib_text(max_bytes: int, seed: int) -> tuple[bytes, tuple[str, ...]]:
    """A seeded choice of stdlib ``.py`` files, at most ``max_bytes`` in all, in path order."""
    root = sysconfig.get_paths().get("stdlib") or ""
    files: list[tuple[str, int]] = []
    if os.path.isdir(root):
        for here, dirs, names in os.walk(root):
            dirs[:] = sorted(d for d in dirs if d not in _SKIP_DIRS)
            for name in names:
                if name.endswith(".py"):
                    full = os.path.join(here, name)
                    try:
                        size = os.path.getsize(full)
                    except OSError:
                        continue
                    files.append((os.path.relpath(full, root).replace(os.sep, "/"), size))
    files.sort()
    random.Random(seed).shuffle(files)
    chosen, total = [], 0
    for rel, size in files:
        if size > 0 and total + size <= max_bytes:
            chosen.append(rel)
            total += size
    chosen.sort()
    parts = []
    for rel in chosen:
        with open(os.path.join(root, rel), "rb") as f:
            parts.append(f.read())
    return b"".join(parts)[:max_bytes], tuple(chosen)


_WORDS = (
    "the a one every no some pipeline stage rank batch tensor gradient schedule model "
    "layer forward backward sends receives holds computes reduces splits merges checks "
    "runs waits small large first last next quiet exact pure slow fast new old and but so "
    "then while"
)


@functools.lru_cache(maxsize=4)
def _generated_text(max_bytes: int, seed: int) -> bytes:
    """Deterministic English-like sentences (a fallback when the stdlib sources are missing)."""
    rng = random.Random(seed)
    vocab = _WORDS.split()
    out: list[str] = []
    size = 0
    while size < max_bytes:
        n = rng.randint(4, 12)
        words = [rng.choice(vocab) for _ in range(n)]
        line = " ".join(words).capitalize() + rng.choice((".", ".", "!", "?")) + "\n"
        out.append(line)
        size += len(line)
    return "".join(out).encode()[:max_bytes]


def _mix(seed: int, split: str, epoch: int) -> int:
    """A 63-bit generator seed from (seed, split, epoch)."""
    digest = hashlib.blake2b(f"funcpipe.data:{seed}:{split}:{epoch}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


@functools.lru_cache(maxsize=8)
def _epoch_order(
    seed: int, split: str, epoch: int, windows: int, context: int
) -> tuple[int, Tensor]:
    """``(shift, order)`` for one epoch: window ``j`` starts at ``shift + j * context`` and the
    epoch visits the windows in the order of the permutation ``order``."""
    g = torch.Generator().manual_seed(_mix(seed, split, epoch))
    shift = int(torch.randint(context, (), generator=g))
    return shift, torch.randperm(windows, generator=g)


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Corpus:
    """A byte-level corpus: ``train`` and ``val`` are 1-D uint8 tensors of token ids.

    Attributes:
        train, val: the two splits (``val`` is the end of the text).
        vocab_size: 256 (a token is a byte).
        source: ``"stdlib"`` or ``"generated"``.
        files: the stdlib files used, relative to the stdlib directory, in corpus order.
        fingerprint: the first 16 hex digits of the SHA-256 of the whole text.
    """

    train: Tensor
    val: Tensor
    source: str
    files: tuple[str, ...]
    fingerprint: str
    vocab_size: int = 256

    def __repr__(self) -> str:
        return (
            f"Corpus(source={self.source!r}, train={self.train.numel()} bytes, "
            f"val={self.val.numel()} bytes, files={len(self.files)}, "
            f"fingerprint={self.fingerprint!r})"
        )

    def split(self, name: str) -> Tensor:
        """The tokens of split ``name`` (``"train"`` or ``"val"``)."""
        if name not in SPLITS:
            raise InvalidArgument(f"split={name!r}: use 'train' or 'val'")
        return self.train if name == "train" else self.val

    def windows(self, split: str, *, context: int) -> int:
        """How many non-overlapping windows of ``context + 1`` tokens an epoch of ``split`` has."""
        n = self.split(split).numel()
        context = check_int("context", context, 1)
        return max(0, (n - context) // context)

    def steps_per_epoch(self, split: str, *, batch: int, context: int, data_size: int = 1) -> int:
        """Steps in one epoch: ``windows // (batch * data_size)`` (the remainder is dropped)."""
        return self.windows(split, context=context) // (batch * data_size)

    def get_batch(
        self,
        split: str,
        step: int,
        *,
        batch: int,
        context: int,
        seed: int,
        data_rank: int = 0,
        data_size: int = 1,
    ) -> tuple[Tensor, Tensor]:
        """This data rank's share of the batch of ``step``: ``(tokens, targets)``.

        Both are int64 tensors of shape ``[batch, context]`` and ``targets`` is ``tokens``
        shifted by one (``targets[:, :-1] == tokens[:, 1:]``). Row ``i`` is
        ``split[s : s + context]`` (and ``split[s + 1 : s + context + 1]``) for the ``i``-th
        start ``s`` of :meth:`window_starts`.
        """
        tokens = self.split(split)
        starts = self.window_starts(
            split, step, batch=batch, context=context, seed=seed,
            data_rank=data_rank, data_size=data_size,
        )  # fmt: skip
        chunk = tokens[starts[:, None] + torch.arange(context + 1)].to(torch.int64)
        return chunk[:, :-1], chunk[:, 1:]

    def window_starts(
        self,
        split: str,
        step: int,
        *,
        batch: int,
        context: int,
        seed: int,
        data_rank: int = 0,
        data_size: int = 1,
    ) -> Tensor:
        """Where the rows of :meth:`get_batch` start in the split: int64 ``[batch]``.

        How batches are drawn: an epoch cuts the split into non-overlapping windows of
        ``context + 1`` tokens, starting at a per-epoch random offset in ``[0, context)``, and
        visits them in a per-epoch random order; both are seeded by ``(seed, split, epoch)``. The
        *global* batch of ``step`` is the next ``batch * data_size`` windows of that order, and
        data rank ``r`` takes rows ``r * batch`` to ``(r + 1) * batch`` of it. So the ranks' shares
        are disjoint (no window is shared, within a step or within an epoch), and the global
        batch does not depend on how it is split: ``data_size=d, batch=b`` over all ranks
        concatenates to ``data_size=1, batch=d * b``. A step never straddles two epochs (the
        last incomplete global batch of an epoch is dropped).
        """
        tokens = self.split(split)
        step = check_int("step", step, 0)
        batch = check_int("batch", batch, 1)
        context = check_int("context", context, 1)
        data_size = check_int("data_size", data_size, 1)
        data_rank = check_int("data_rank", data_rank, 0)
        if data_rank >= data_size:
            raise InvalidArgument(
                f"data_rank={data_rank!r} must be < data_size={data_size!r} (ranks 0..{data_size - 1})"
            )
        check_int("seed", seed, None)
        windows = self.windows(split, context=context)
        per_step = batch * data_size
        if per_step > windows:
            raise InvalidArgument(
                f"batch={batch} x data_size={data_size} = {per_step} windows of context={context} "
                f"per step, but the {split!r} split ({tokens.numel()} tokens) has only {windows}; "
                "use a smaller batch or context"
            )
        epoch, i = divmod(step, windows // per_step)
        shift, order = _epoch_order(seed, split, epoch, windows, context)
        first = i * per_step + data_rank * batch
        return shift + order[first : first + batch] * context

    def batches(
        self,
        split: str,
        *,
        batch: int,
        context: int,
        seed: int,
        data_rank: int = 0,
        data_size: int = 1,
        start: int = 0,
        steps: int | None = None,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        """``get_batch(split, step, ...)`` for ``step = start, start + 1, ...``.

        Endless unless ``steps`` is given. To resume after step ``k``, pass ``start=k + 1``.
        """
        self.get_batch(  # validate now, not at the first next()
            split, start, batch=batch, context=context, seed=seed,
            data_rank=data_rank, data_size=data_size,
        )  # fmt: skip
        if steps is not None:
            check_int("steps", steps, 0)
        return self._iterate(split, batch, context, seed, data_rank, data_size, start, steps)

    def _iterate(
        self,
        split: str,
        batch: int,
        context: int,
        seed: int,
        data_rank: int,
        data_size: int,
        start: int,
        steps: int | None,
    ) -> Iterator[tuple[Tensor, Tensor]]:
        step = start
        while steps is None or step < start + steps:
            yield self.get_batch(
                split, step, batch=batch, context=context, seed=seed,
                data_rank=data_rank, data_size=data_size,
            )  # fmt: skip
            step += 1

    def decode(self, tokens: Tensor) -> str:
        """Bytes back to text (invalid UTF-8 is replaced)."""
        return bytes(tokens.to(torch.uint8).flatten().tolist()).decode("utf-8", errors="replace")

    @staticmethod
    def encode(text: str) -> Tensor:
        """Text to a 1-D int64 tensor of UTF-8 bytes."""
        return torch.tensor(list(text.encode()), dtype=torch.int64)


def load_corpus(
    *,
    max_bytes: int = 3_000_000,
    seed: int = 0,
    val_fraction: float = 0.1,
    source: str = "auto",
) -> Corpus:
    """The offline corpus: stdlib sources (or generated text), split into train and val.

    Args:
        max_bytes: size cap of the whole text (default 3 MB), >= 1024.
        seed: chooses the stdlib files (and seeds the generated text).
        val_fraction: the share of bytes, at the end, that forms ``val``; in (0, 1).
        source: ``"stdlib"`` (raise if the sources are missing), ``"generated"``, or ``"auto"``
            (stdlib, falling back to generated text).
    """
    max_bytes = check_int("max_bytes", max_bytes, 1024)
    check_int("seed", seed, None)
    if (
        not isinstance(val_fraction, (int, float))
        or isinstance(val_fraction, bool)
        or not 0.0 < val_fraction < 1.0
    ):
        raise InvalidArgument(f"val_fraction={val_fraction!r}: a number in (0, 1), e.g. 0.1")
    if source not in ("auto", "stdlib", "generated"):
        raise InvalidArgument(f"source={source!r}: use 'auto', 'stdlib' or 'generated'")
    text: bytes = b""
    files: tuple[str, ...] = ()
    if source != "generated":
        text, files = _stdlib_text(max_bytes, seed)
        if len(text) < 1024:
            if source == "stdlib":
                raise InvalidArgument(
                    f"source='stdlib': no Python sources found under "
                    f"{sysconfig.get_paths().get('stdlib')!r}; use source='auto' or 'generated'"
                )
            text, files = b"", ()
    kind = "stdlib" if text else "generated"
    if not text:
        text = _generated_text(max_bytes, seed)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    n_val = max(1, int(len(text) * val_fraction))
    return Corpus(
        train=data[: len(text) - n_val].clone(),
        val=data[len(text) - n_val :].clone(),
        source=kind,
        files=files,
        fingerprint=hashlib.sha256(text).hexdigest()[:16],
    )
