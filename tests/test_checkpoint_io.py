"""Checkpoint I/O failures (issue 33): a failed write surfaces its OSError, a corrupt payload
fails loading by its checksum, and the demo finds an unwritable --out or a --resume without a
checkpoint before it trains."""

from __future__ import annotations

import errno
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from funcpipe.cli import demo
from funcpipe.errors import FuncpipeError, InvalidArgument
from funcpipe.train import checkpoint


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
    class FullDisk(checkpoint.FileSystemWriter):
        def write_data(self, *args: Any, **kwargs: Any) -> Any:
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, "FileSystemWriter", FullDisk)
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
