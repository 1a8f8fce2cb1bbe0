"""Checkpoint I/O failures (issue 33): a failed write surfaces its OSError, a corrupt payload
fails loading by its checksum, and the demo finds an unwritable --out or a --resume without a
checkpoint before it trains."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from funcpipe.cli import demo
from funcpipe.errors import FuncpipeError, InvalidArgument
from funcpipe.train import checkpoint, checkpoint_write


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(64, 64, generator=g),
        "b": torch.randn(5, generator=g, dtype=torch.float64).to(torch.bfloat16),
        "step": 3,
    }


def _like() -> dict[str, Any]:
    return {"w": torch.zeros(64, 64), "b": torch.zeros(5, dtype=torch.bfloat16), "step": 0}


def test_a_save_into_a_path_under_a_file_raises_the_oserror(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="Not a directory") as e:
        checkpoint.save(tmp_path / "file" / "ck", _state())
    if sys.version_info >= (3, 11):  # the note needs add_note
        assert "could not write the checkpoint" in "\n".join(e.value.__notes__)


def test_a_full_disk_raises_the_oserror_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    class FullDisk(checkpoint_write.FileSystemWriter):
        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_write, "FileSystemWriter", FullDisk)
    with pytest.raises(OSError, match="No space left on device") as e:
        checkpoint.save(tmp_path / "ck", _state())
    assert e.value.errno == errno.ENOSPC
    assert os.listdir(tmp_path) == []  # the unfinished .tmp- directory is removed


def test_checksums_are_recorded_and_verified(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "ck", _state(), step=3)
    info = json.loads((Path(path) / checkpoint.INFO).read_text())
    assert set(info["checksums"]) == {"w", "b", "step"}
    got = checkpoint.load(path, _like())
    assert torch.equal(got["w"], _state()["w"]) and got["step"] == 3


def _payload(path: str, key: str) -> tuple[Path, int, int]:
    """(file, offset, length) of ``key``'s bytes in a saved checkpoint."""
    metadata = checkpoint._SafeReader(path).read_metadata()
    for index, item in metadata.storage_data.items():
        if index.fqn == key:
            return Path(path) / item.relative_path, item.offset, item.length
    raise KeyError(key)


def test_a_flipped_bit_fails_loading_naming_the_key(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "ck", _state())
    file, offset, length = _payload(path, "w")
    raw = bytearray(file.read_bytes())
    raw[offset + length // 2] ^= 0x10  # one bit in the middle of the 16 KB of tensor data
    file.write_bytes(bytes(raw))
    with pytest.raises(FuncpipeError, match=r"is corrupt: the data of key 'w'"):
        checkpoint.load(path, _like())


def test_checkpoints_without_checksums_still_load(tmp_path: Path) -> None:
    path = checkpoint.save(tmp_path / "ck", _state())
    info_file = Path(path) / checkpoint.INFO
    info = json.loads(info_file.read_text())
    del info["checksums"]
    info_file.write_text(json.dumps(info))
    assert checkpoint.load(path, _like())["step"] == 3


def _opts(*args: str) -> demo.DemoOptions:
    return demo.parse(["--steps", "2", "--device", "cpu", *args])


def test_demo_unwritable_out_is_found_before_training(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(InvalidArgument, match="--out .* cannot be written .*NotADirectoryError"):
        demo.run(_opts("--out", str(tmp_path / "file" / "run")))


def test_demo_resume_without_a_checkpoint_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="--resume: there is no complete checkpoint"):
        demo.run(_opts("--out", str(tmp_path), "--resume"))
    assert not any(tmp_path.iterdir())  # the write probe is gone


def test_demo_resume_options_as_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """``--resume`` alone must find a checkpoint, ``--resume auto`` takes one if there is one,
    and without the option a torchrun job resumes by itself (its restarts rerun the command)."""
    for name in ("TORCHELASTIC_RESTART_COUNT", "RANK", "WORLD_SIZE", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert _opts("--resume").resume is True
    assert _opts("--resume", "auto").resume == "auto"
    assert _opts("--resume", "no").resume is False and _opts().resume is False
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    assert _opts().resume == "auto" and _opts("--resume", "no").resume is False


@pytest.mark.parametrize(("option", "value"), [("--batch", "4"), ("--data", "2")])
def test_demo_resume_at_another_batch_or_data_is_refused(
    tmp_path: Path, option: str, value: str
) -> None:
    """docs: keep --data and --batch; a resume at others ran on, with other losses."""
    checkpoint.save(tmp_path / "checkpoint", {"w": torch.ones(1)}, step=1)
    (tmp_path / "run.json").write_text(json.dumps({k: getattr(_opts(), k) for k in demo._KEPT}))
    with pytest.raises(InvalidArgument, match=f"was trained with {option} "):
        demo.run(_opts("--out", str(tmp_path), "--resume", option, value))


def test_demo_refuses_a_program_too_large_to_build(tmp_path: Path) -> None:
    start = time.perf_counter()
    with pytest.raises(InvalidArgument, match="1,000,000 .* pairs a step"):
        demo.run(_opts("--out", str(tmp_path), "--microbatches", "500000", "--batch", "500000"))
    with pytest.raises(InvalidArgument, match="--batch 8 < --microbatches 500000"):
        demo.run(_opts("--out", str(tmp_path), "--microbatches", "500000"))
    assert time.perf_counter() - start < 10  # (before: generating it ran to the deadline)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--checkpoint-every", "-1"], "--checkpoint-every=-1: a step count >= 1"),
        (["--keep", "0"], "--keep=0: how many checkpoints to keep"),
    ],
)
def test_demo_checkpoint_options_are_checked(args: list[str], says: str, tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(says)):
        demo.run(_opts("--out", str(tmp_path), *args))
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------------------ issue 42
def test_a_corrupt_funcpipe_json_is_named_not_called_missing(tmp_path: Path) -> None:
    """Both files were there, and the error said 'no funcpipe.json and .metadata'."""
    path = checkpoint.save(tmp_path / "ck", _state(), step=3)
    info_file = Path(path) / checkpoint.INFO
    good = info_file.read_text()
    info_file.write_text(good[: len(good) // 2])  # cut short
    with pytest.raises(InvalidArgument) as e:
        checkpoint.load(path, _like())
    text = str(e.value)
    assert "its funcpipe.json is corrupt" in text and "no funcpipe.json and .metadata" not in text
    assert "line" in text and "load an earlier checkpoint" in text, text
    assert checkpoint.latest(tmp_path) is None  # latest still skips it
    info_file.write_text(json.dumps({"format": "something else"}))
    with pytest.raises(InvalidArgument, match="was not written by funcpipe.train.checkpoint"):
        checkpoint.load(path, _like())
    info_file.write_text(good)
    (Path(path) / ".metadata").unlink()
    with pytest.raises(InvalidArgument, match=r"it has a funcpipe.json but no \.metadata"):
        checkpoint.load(path, _like())
    with pytest.raises(InvalidArgument, match=r"\(no funcpipe.json and \.metadata\)"):
        checkpoint.load(tmp_path / "nothing", _like())  # as before


class _FillingDisk(checkpoint_write.FileSystemWriter):
    """A disk with ``room`` bytes left for the data files: the write that crosses it raises
    ENOSPC, as a full disk does (torch's zip writer then raised its own 'unexpected pos')."""

    room = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        fs, left = self.fs, [self.room]
        create_stream = fs.create_stream

        class Stream:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def write(self, data: Any) -> int:
                n = memoryview(data).nbytes
                if n > left[0]:
                    raise OSError(errno.ENOSPC, "No space left on device")
                left[0] -= n
                return int(self.inner.write(data))

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

        @contextlib.contextmanager
        def filling(path: Any, mode: str) -> Iterator[Any]:
            with create_stream(path, mode) as stream:
                yield Stream(stream) if "w" in mode and str(path).endswith(".distcp") else stream

        fs.create_stream = filling  # type: ignore[method-assign]


@pytest.mark.parametrize("room", [0, 100, 700, 5000])
def test_a_disk_that_fills_midway_raises_enospc_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, room: int
) -> None:
    """Full after ``room`` bytes: the OSError, never torch's 'unexpected pos 704 vs 598'; the
    checkpoint saved before is intact and nothing else is left."""
    path = checkpoint.save(tmp_path / "ck", _state(), step=3)
    monkeypatch.setattr(_FillingDisk, "room", room)
    monkeypatch.setattr(checkpoint_write, "FileSystemWriter", _FillingDisk)
    newer = {**_state(), "step": 4}
    with pytest.raises(OSError, match="No space left on device") as e:
        checkpoint.save(path, newer, step=4)
    assert e.value.errno == errno.ENOSPC
    if sys.version_info >= (3, 11):
        assert "could not write the checkpoint" in "\n".join(e.value.__notes__)
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert checkpoint.load(path, _like())["step"] == 3


def test_a_full_disk_at_funcpipe_json_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills as rank 0 writes funcpipe.json, after the tensors: its OSError with the
    note, the unfinished directory removed, the previous checkpoint kept."""
    path = checkpoint.save(tmp_path / "ck", _state(), step=3)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint_write.json, "dump", full)
    with pytest.raises(OSError, match="No space left on device") as e:
        checkpoint.save(path, _state(), step=4)
    if sys.version_info >= (3, 11):
        assert "could not write the checkpoint" in "\n".join(e.value.__notes__)
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path)) == ["ck"]
    assert checkpoint.load(path, _like())["step"] == 3


@pytest.mark.parametrize("damage", ["emptied", "truncated", "deleted"])
def test_a_damaged_data_file_is_named(tmp_path: Path, damage: str) -> None:
    """An emptied data file gave a bare EOFError from inside torch.load."""
    path = checkpoint.save(tmp_path / "ck", _state())
    file, offset, length = _payload(path, "w")
    size = file.stat().st_size
    if damage == "deleted":
        file.unlink()
    else:
        file.write_bytes(file.read_bytes()[: 0 if damage == "emptied" else offset + length // 2])
    with pytest.raises(FuncpipeError) as e:
        checkpoint.load(path, _like())
    text = str(e.value)
    assert f"data file {file.name!r}" in text and "load an earlier checkpoint" in text.lower()
    if damage == "deleted":
        assert "is missing" in text, text
    else:
        assert f"is {file.stat().st_size:,} bytes, but the metadata records data up to" in text
        assert "truncated" in text and size > file.stat().st_size, text
    assert "EOFError" not in text and "PytorchStreamReader" not in text, text


def full_disk_at_funcpipe_json_on_rank_0(rank: int, path: str) -> tuple[str, bool]:
    """Pool job: rank 0's disk fills as it writes funcpipe.json, after every rank wrote its
    tensors; returns (the error, whether the checkpoint saved before still loads)."""
    from unittest import mock

    import torch.distributed as dist

    state = {"w": torch.ones(3), "step": rank}
    checkpoint.save(path, {"w": torch.ones(3)}, step=1)

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    with mock.patch.object(checkpoint_write.json, "dump", full if rank == 0 else json.dump):
        try:
            checkpoint.save(path, {"w": state["w"] * 2}, step=2)
            error = "saved"
        except (OSError, FuncpipeError) as e:
            error = f"{type(e).__name__}: {e}"
    dist.barrier()
    kept = torch.equal(checkpoint.load(path, {"w": torch.zeros(3)})["w"], torch.ones(3))
    return error, kept


@pytest.mark.timeout(90)
def test_a_full_disk_at_funcpipe_json_on_rank_0_fails_every_rank_at_once(
    pool: Any, tmp_path: Path
) -> None:
    """The other ranks waited in a barrier for rank 0, until the process group's timeout."""
    start = time.perf_counter()
    (e0, kept0), (e1, kept1) = pool(2).run(
        full_disk_at_funcpipe_json_on_rank_0, str(tmp_path / "ck")
    )
    assert time.perf_counter() - start < 30
    assert e0 == "OSError: [Errno 28] No space left on device"
    assert e1.startswith("FuncpipeError: rank 0 could not finish the checkpoint"), e1
    assert "writing funcpipe.json" in e1 and "previous checkpoint there, if any, was kept" in e1
    assert kept0 and kept1
