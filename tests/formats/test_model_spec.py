"""What every exported file says about itself: the SAI model spec, read back from the file with safetensors.

Each family's tiny model gets each method it trains set up on it (no training: the adapters and tokens as they
start), with the facts a run records (its title, resolution and start), and writes its deliverable through the
method's own `save_final`, as a run's end does. Every `.safetensors` it writes must carry the spec's MUST keys
(Stability-AI/ModelSpec README.md: sai_model_spec, architecture, implementation, title, resolution) and what
sd-scripts adds to them (library/sai_model_spec.py at 48d368f `build_metadata_dataclass`: the date, the prediction type
but for the flow families), the architecture and implementation as sd-scripts names them for that kind of file; a
whole model also says what it predicts as ComfyUI's saver does (`modelspec.predict_key`).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rangefinder.formats.model_spec import SpecFacts
from rangefinder.formats.weights_file import read_metadata

FACTS = SpecFacts(title="rangefinder-sd", resolution=32, date="2025-06-01T08:30:00+00:00")
SGM = "https://github.com/Stability-AI/generative-models"
BFL = "https://github.com/black-forest-labs/flux"
TOKEN = "<rf-concept>"

# (family, method) -> {file under final/: (architecture, implementation)}. SD 1.x and SDXL predict epsilon here (the
# tiny models' schedulers); SD3 and Flux predict neither.
EXPECTED = {
    ("sd1", "full"): {"model.safetensors": ("stable-diffusion-v1", SGM)},
    ("sd1", "lora"): {"pytorch_lora_weights.safetensors": ("stable-diffusion-v1/lora", "diffusers"),
                      "lora_kohya.safetensors": ("stable-diffusion-v1/lora", "diffusers")},
    ("sd1", "textual_inversion"): {
        "learned_embeds.safetensors": ("stable-diffusion-v1/textual-inversion", "diffusers"),
        "a1111/rf-concept.safetensors": ("stable-diffusion-v1/textual-inversion", SGM)},
    ("sdxl", "full"): {"model.safetensors": ("stable-diffusion-xl-v1-base", SGM)},
    ("sdxl", "lora"): {"pytorch_lora_weights.safetensors": ("stable-diffusion-xl-v1-base/lora", "diffusers"),
                       "lora_kohya.safetensors": ("stable-diffusion-xl-v1-base/lora", SGM)},
    ("sdxl", "textual_inversion"): {
        "learned_embeds.safetensors": ("stable-diffusion-xl-v1-base/textual-inversion", SGM),
        "a1111/rf-concept.safetensors": ("stable-diffusion-xl-v1-base/textual-inversion", SGM)},
    ("sd3", "full"): {"model.safetensors": ("stable-diffusion-3-5-large", SGM)},
    ("sd3", "lora"): {"pytorch_lora_weights.safetensors": ("stable-diffusion-3-5-large/lora", "diffusers"),
                      "lora_kohya.safetensors": ("stable-diffusion-3-5-large/lora", SGM)},
    ("flux", "full"): {"model.safetensors": ("flux-1-dev", BFL)},
    ("flux", "lora"): {"pytorch_lora_weights.safetensors": ("flux-1-dev/lora", "diffusers"),
                       "lora_kohya.safetensors": ("flux-1-dev/lora", BFL)},
}
PREDICTS = {"sd1": "epsilon", "sdxl": "epsilon", "sd3": None, "flux": None}


@pytest.mark.parametrize(("family", "method"), list(EXPECTED), ids=[f"{f}-{m}" for f, m in EXPECTED])
def test_every_exported_file_carries_the_model_spec_of_what_it_is(request, tmp_path, family, method):
    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.models.fingerprint import folder_revision
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.methods import make_method

    folder = request.getfixturevalue({"sd1": "tiny_model_dir", "sdxl": "tiny_sdxl_dir", "sd3": "tiny_sd3_dir",
                                      "flux": "tiny_flux_dir"}[family])
    sd = load_sd_components(ModelConfig(base_model=str(folder)))
    assert sd.family == family
    trainer = make_method(TrainingConfig(method=method, textual_inversion={"placeholder_token": TOKEN}))
    trainer.setup(sd, torch.float32)
    trainer.spec_facts = FACTS  # as the run's end sets it (training/loop.py _finish)
    trainer.save_final(sd, tmp_path)

    written = {p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("*.safetensors")}
    written |= {p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("a1111/*.safetensors")}
    assert written == set(EXPECTED[family, method])  # every file a user picks up, and no other
    # Each names the weights it was trained on, not only the folder's path, which keeps its name when they change.
    revision = folder_revision(Path(folder))
    assert revision.startswith("weights:")
    assert {name: read_metadata(tmp_path / name).get("rangefinder.base_model_revision") for name in written} == \
        dict.fromkeys(written, revision)
    if method == "lora":  # sd-scripts names a folder by its name; the hashes it writes of one are no hashes
        kohya = read_metadata(tmp_path / "lora_kohya.safetensors")
        assert {k: v for k, v in kohya.items() if k.startswith("ss_sd_model") or k.startswith("ss_new_sd")} == \
            {"ss_sd_model_name": Path(folder).name}
    predicts = {"epsilon": "epsilon", "v_prediction": "v", None: None}[PREDICTS[family]]
    for name, (architecture, implementation) in EXPECTED[family, method].items():
        spec = {k: v for k, v in read_metadata(tmp_path / name).items() if k.startswith("modelspec.")}
        expected = {"modelspec.sai_model_spec": "1.0.1", "modelspec.architecture": architecture,
                    "modelspec.implementation": implementation, "modelspec.title": "rangefinder-sd",
                    "modelspec.resolution": "32x32", "modelspec.date": "2025-06-01T08:30:00+00:00"}
        if predicts is not None:
            expected["modelspec.prediction_type"] = predicts
            if method == "full":
                expected["modelspec.predict_key"] = predicts  # ComfyUI's saver's key, for a whole model
        assert spec == expected, name


def test_without_the_run_s_facts_a_file_still_names_its_base_model(tiny_model_dir, tmp_path):
    """Exported outside a run (formats' functions called alone), a file keeps the spec's keys it can know."""
    from rangefinder.formats.single_file import export_full

    spec = {k: v for k, v in read_metadata(export_full(Path(tiny_model_dir), tmp_path / "m.safetensors")).items()
            if k.startswith("modelspec.")}
    assert spec == {"modelspec.sai_model_spec": "1.0.1", "modelspec.architecture": "stable-diffusion-v1",
                    "modelspec.implementation": SGM, "modelspec.prediction_type": "epsilon",
                    "modelspec.predict_key": "epsilon"}


@pytest.mark.parametrize(("base", "revision", "named"), [
    ("org/sd-model@main", "a" * 40, {"ss_sd_model_name": "org/sd-model"}),  # a hub id, as sd-scripts is given it
    ("embedded tiny model (/cache/tiny-sd)", "weights:" + "b" * 32, {}),  # nothing sd-scripts could have named
    ("/gone/model.safetensors", "sha256:" + "c" * 64,  # a file this step cannot read: its sha256, no old hash
     {"ss_sd_model_name": "model.safetensors", "ss_new_sd_model_hash": "c" * 64}),
    ("~rf-no-such-user/model.safetensors", "sha256:" + "c" * 64,  # another machine's user: no RuntimeError
     {"ss_sd_model_name": "model.safetensors", "ss_new_sd_model_hash": "c" * 64}),
])
def test_a_kohya_lora_names_a_hub_id_or_an_unread_file_as_sd_scripts_does(base, revision, named):
    from rangefinder.formats.lora import kohya_base_model

    assert kohya_base_model({"rangefinder.base_model": base, "rangefinder.base_model_revision": revision}) == named


def test_a_kohya_lora_of_a_file_named_under_home_carries_its_old_hash(tmp_path, monkeypatch):
    """A pipeline's steps name a single file as model.base_model gave it (describe_base_model), `~/...` unexpanded:
    legacy_model_hash opened that literally, failed, and the LoRA lost ss_sd_model_hash, which the file's own
    sd-scripts run would have written."""
    import hashlib

    from rangefinder.formats.lora import LEGACY_HASH_LENGTH, LEGACY_HASH_OFFSET, kohya_base_model

    monkeypatch.setenv("HOME", str(tmp_path))
    data = bytes(range(256)) * ((LEGACY_HASH_OFFSET + LEGACY_HASH_LENGTH) // 256 + 1)
    (tmp_path / "sd15.safetensors").write_bytes(data)
    named = kohya_base_model({"rangefinder.base_model": "~/sd15.safetensors",
                              "rangefinder.base_model_revision": "sha256:" + "c" * 64})
    old = hashlib.sha256(data[LEGACY_HASH_OFFSET:LEGACY_HASH_OFFSET + LEGACY_HASH_LENGTH]).hexdigest()[:8]
    assert named == {"ss_sd_model_name": "sd15.safetensors", "ss_new_sd_model_hash": "c" * 64,
                     "ss_sd_model_hash": old}


@pytest.mark.parametrize("folder", ["sd15", "gone"])
def test_a_kohya_lora_without_the_revision_names_a_folder_under_home_by_its_name(folder, tmp_path, monkeypatch):
    """A file without rangefinder.base_model_revision (an older release's) naming its base model `~/...`, as the run
    spelt it: Path(base).exists() read `~` literally, so a folder there, or one this machine does not have, was
    named as a hub id is, by its whole spelling `~/sd15`; sd-scripts names a folder by its basename
    (train_network.py at 48d368f, lines 1208-1213)."""
    from rangefinder.formats.lora import kohya_base_model

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sd15").mkdir()
    assert kohya_base_model({"rangefinder.base_model": f"~/{folder}"}) == {"ss_sd_model_name": folder}


@pytest.mark.parametrize("method", ["lora", "textual_inversion"])
def test_a_delivered_file_names_a_base_model_under_home_from_tilde(method, tiny_model_dir, tmp_path, monkeypatch):
    """A LoRA or an embedding is made to be shared, and every file's header named the base model's whole path: a
    folder under the trainer's home told everyone its account name (/home/<user>/...). It says `~/...` instead, and
    what sd-scripts and A1111 show of it is the folder's name, as before."""
    from tests.conftest import delivered_files

    home = tiny_model_dir.parent
    monkeypatch.setenv("HOME", str(home))
    out = delivered_files(tiny_model_dir, method, tmp_path)
    files = sorted(out.rglob("*.safetensors"))
    assert len(files) == 2
    for path in files:
        meta = read_metadata(path)
        assert not [k for k, v in meta.items() if str(home) in v], path.name
        assert meta["rangefinder.base_model"] == f"~/{tiny_model_dir.name}"
    if method == "lora":
        assert read_metadata(out / "lora_kohya.safetensors")["ss_sd_model_name"] == tiny_model_dir.name
    else:
        pt = torch.load(out / "a1111" / "rf-concept.pt", map_location="cpu", weights_only=True)
        assert pt["sd_checkpoint_name"] == tiny_model_dir.name


def test_a_file_written_by_a_process_with_no_home_folder_names_its_base_model_whole(monkeypatch):
    """HOME unset, and the process's user not in the passwd database (a container run under an arbitrary UID): the
    home folder cannot be told, and writing a base model's path from `~` ended the export of a finished training in
    pathlib's RuntimeError ("Could not determine home directory")."""
    import pwd

    from rangefinder.formats.weights_file import export_metadata

    def no_such_user(uid: int):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_such_user)
    meta = export_metadata(method="lora", base_model="/models/sd15", base_model_revision="weights:0")
    assert meta["rangefinder.base_model"] == "/models/sd15"
