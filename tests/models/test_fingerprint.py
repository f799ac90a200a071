"""A local folder's revision (models/fingerprint.py): the fingerprint of its weights that tells a schedule the files
in a base model's folder were replaced, read off real copies of the tiny model's folder."""

from __future__ import annotations

import json
import pickle
import shutil
import struct
from pathlib import Path

import pytest

from rangefinder.config import ModelConfig, demo_config
from rangefinder.errors import ConfigError
from rangefinder.models import fingerprint
from rangefinder.models.fingerprint import SAMPLE_BYTES, folder_revision
from rangefinder.models.loading import resolve_base_model
from rangefinder.steps.resolve_config import with_resolved_base_model

UNET_WEIGHTS = Path("unet") / "diffusion_pytorch_model.safetensors"


def last_tensor_data_at(path: Path) -> int:
    """Where the data of the file's last tensor (by offset) begins, in bytes from the file's start."""
    (length,) = struct.unpack("<Q", path.read_bytes()[:8])
    header = json.loads(path.read_bytes()[8:8 + length])
    return 8 + length + max(v["data_offsets"][0] for k, v in header.items() if k != "__metadata__")


def flip_byte(path: Path, at: int) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_folder_s_revision_changes_with_its_weights_and_only_with_them(tiny_model_dir, tmp_path, monkeypatch):
    """A team retrains weekly from a folder whose weights someone replaces: the folder resolved with no revision, so
    both weeks' versions read as made from the same base model. Its revision is now a fingerprint of its files, the
    same for the same files wherever they lie, and another for one tensor's leading bytes changed."""
    folder = tmp_path / "sd15"
    shutil.copytree(tiny_model_dir, folder)
    resolved = resolve_base_model(ModelConfig(base_model=str(folder)))
    assert resolved.revision is not None and resolved.revision.startswith("weights:"), resolved.revision
    assert len(resolved.revision) == len("weights:") + 32
    # The same files: the same revision, in the copy and in the embedded model's own folder.
    assert resolve_base_model(ModelConfig(base_model=str(tiny_model_dir))).revision == resolved.revision
    assert resolve_base_model(ModelConfig(cache_dir=str(tiny_model_dir.parent))).revision == resolved.revision
    # One tensor's leading bytes (where any fine-tune changes them): another revision.
    at = last_tensor_data_at(folder / UNET_WEIGHTS)
    flip_byte(folder / UNET_WEIGHTS, at)
    changed = resolve_base_model(ModelConfig(base_model=str(folder))).revision
    assert changed != resolved.revision
    with monkeypatch.context() as m:  # read a sample at a time, as a large model's files: the same revisions as the
        m.setattr(fingerprint, "ONE_READ_BYTES", 0)  # tiny model's one read a file gives
        assert (folder_revision(folder), folder_revision(tiny_model_dir)) == (changed, resolved.revision)
    flip_byte(folder / UNET_WEIGHTS, at)
    assert folder_revision(folder) == resolved.revision  # put back: the revision it had
    # So does the scheduler's config (another noise schedule trains another model).
    scheduler = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(scheduler.read_text())
    scheduler.write_text(json.dumps({**config, "beta_end": 0.02}))
    assert folder_revision(folder) not in (resolved.revision, changed)
    # What it does not read, as its docstring says: a byte past a tensor's first SAMPLE_BYTES.
    shutil.copyfile(tiny_model_dir / "scheduler" / "scheduler_config.json", scheduler)
    flip_byte(folder / UNET_WEIGHTS, at + SAMPLE_BYTES)
    assert folder_revision(folder) == resolved.revision


@pytest.mark.parametrize("damage, says", [
    (lambda data: struct.pack("<Q", 1 << 40) + data[8:], "its first 8 bytes give a header of 1099511627776 bytes"),
    (lambda data: data[:8] + b"\xff" + data[9:], "its header is not JSON"),
    (lambda data: data[:len(data) // 2], "it is cut short: its header places tensor"),
])
def test_a_damaged_weights_file_in_a_folder_is_named_in_one_line(damage, says, tiny_model_dir, tmp_path):
    folder = tmp_path / "sd15"
    shutil.copytree(tiny_model_dir, folder)
    path = folder / UNET_WEIGHTS
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(ConfigError) as e:  # resolve-config asks for the revision as it resolves the model
        with_resolved_base_model(demo_config(model={"base_model": str(folder)}))
    assert str(e.value).startswith(f"model.base_model: {path} is not a readable safetensors file ({says}"), str(e.value)
    assert "\n" not in str(e.value) and str(e.value).endswith("copy the model's folder again from where it came, or "
                                                             "replace that file")


class _RunsCode:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_pickle_weights_are_fingerprinted_unread(tiny_model_dir, tmp_path):
    """A part with .bin weights (which the load reads tensors-only) is fingerprinted by its bytes, never unpickled:
    the revision changes with them, and the code a pickle names does not run."""
    folder = tmp_path / "sd15"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "code-ran"
    (folder / "text_encoder" / "model.safetensors").unlink()
    weights = folder / "text_encoder" / "pytorch_model.bin"
    weights.write_bytes(pickle.dumps({"payload": _RunsCode(marker), "pad": b"\0" * 4096}))
    first = folder_revision(folder)
    flip_byte(weights, weights.stat().st_size - 100)
    assert folder_revision(folder) != first and not marker.exists()


def test_a_loaded_folder_s_revision_is_that_of_the_weights_it_loaded(tiny_model_dir, tmp_path):
    """`rangefinder train` asks a folder's revision first when it writes its files (output_metadata), hours after the
    load: weights replaced in the folder meanwhile, the very case the fingerprint is for, were named as those the
    run trained on, and a replacement caught half-copied failed the run's last write. It is read as the folder is
    loaded."""
    from rangefinder.models.loading import load_sd_components

    folder = tmp_path / "sd15"
    shutil.copytree(tiny_model_dir, folder)
    loaded_from = folder_revision(folder)
    sd = load_sd_components(ModelConfig(base_model=str(folder)))
    flip_byte(folder / UNET_WEIGHTS, last_tensor_data_at(folder / UNET_WEIGHTS))  # replaced after the load
    assert sd.resolved is not None and sd.resolved.revision == loaded_from
