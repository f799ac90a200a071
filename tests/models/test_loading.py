"""The base model from each source (embedded, folder, single file, hub id), resolved to one local diffusers folder;
and each bad source's one clear error."""

import hashlib
import re
from pathlib import Path

import pytest
import torch

from rangefinder.config import ModelConfig, TrainingConfig
from rangefinder.errors import ConfigError
from rangefinder.formats.weights_file import read_metadata, under_home
from rangefinder.models.loading import load_sd_components, resolve_base_model
from rangefinder.training.methods import make_method
from tests.conftest import HUB_REPO, delivered_files
from tests.models.fake_hub import FakeHubServer


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture(scope="module")
def folder_parts(tiny_model_dir):
    return load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))


@pytest.fixture
def offline_hub(fake_hub_cache, monkeypatch):
    cache, commit = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache, commit


def test_folder_and_embedded_default(tiny_model_dir, folder_parts):
    from diffusers import DDPMScheduler

    assert folder_parts.kind == "folder" and folder_parts.model_dir == tiny_model_dir.resolve()
    assert isinstance(folder_parts.noise_scheduler, DDPMScheduler)
    assert folder_parts.noise_scheduler.config.prediction_type == "epsilon"
    assert folder_parts.tokenizer("object", add_special_tokens=False).input_ids.__len__() == 1
    assert not folder_parts.unet.training
    embedded = load_sd_components(ModelConfig(cache_dir=str(tiny_model_dir.parent)))
    assert embedded.kind == "embedded" and str(tiny_model_dir) in embedded.source
    assert _same_weights(embedded.unet, folder_parts.unet)


def test_single_file_is_converted_once_into_a_diffusers_folder(tiny_model_dir, folder_parts, tmp_path):
    from rangefinder.formats.single_file import export_full
    from rangefinder.formats.weights_file import export_metadata

    meta = export_metadata(method="full", base_model=str(tiny_model_dir), lr=1e-4, epochs=1, updates=1)
    path = export_full(tiny_model_dir, tmp_path / "tiny.safetensors", meta)
    cfg = ModelConfig(base_model=str(path), cache_dir=str(tmp_path / "cache"))
    # The architecture comes from the base model named in the file's metadata: nothing is fetched.
    resolved = resolve_base_model(cfg)
    assert resolved.kind == "single_file" and resolved.source == str(path)
    assert resolved.path.is_relative_to(tmp_path / "cache" / "base-models")
    assert (resolved.path / "model_index.json").is_file()
    parts = load_sd_components(cfg)
    assert parts.kind == "single_file" and parts.model_dir == resolved.path
    for name in ("unet", "vae", "text_encoder"):
        assert _same_weights(getattr(parts, name), getattr(folder_parts, name)), name
    assert parts.vae.config.scaling_factor == folder_parts.vae.config.scaling_factor
    # Converted once: a second resolution finds the folder (same files, untouched).
    stamp = (resolved.path / "model_index.json").stat().st_mtime_ns
    assert resolve_base_model(cfg).path == resolved.path
    assert (resolved.path / "model_index.json").stat().st_mtime_ns == stamp
    # Without metadata, model.single_file_config names the architecture; another file is another folder.
    bare = export_full(tiny_model_dir, tmp_path / "bare.safetensors")
    other = resolve_base_model(ModelConfig(base_model=str(bare), single_file_config=str(tiny_model_dir),
                                           cache_dir=str(tmp_path / "cache")))
    assert other.path != resolved.path
    # So is another file of the same name (a newer download of tiny.safetensors): it is converted, not taken for the
    # folder the first one was converted to.
    (tmp_path / "newer").mkdir()
    newer = export_full(tiny_model_dir, tmp_path / "newer" / "tiny.safetensors", {**meta, "epochs": "2"})
    assert resolve_base_model(ModelConfig(base_model=str(newer), cache_dir=str(tmp_path / "cache"))).path \
        not in (resolved.path, other.path)
    parts = load_sd_components(ModelConfig(base_model=str(bare), single_file_config=str(tiny_model_dir),
                                           cache_dir=str(tmp_path / "cache")))
    assert _same_weights(parts.unet, folder_parts.unet)
    # A LoRA trained on it names the file it came from by the file's own sha256, which no move or rename changes.
    lora = make_method(TrainingConfig(method="lora"))
    lora.setup(parts, torch.float32)
    lora.save_final(parts, tmp_path / "lora")
    sha256 = hashlib.sha256(bare.read_bytes()).hexdigest()
    for name in ("lora_kohya.safetensors", "pytorch_lora_weights.safetensors"):
        meta = read_metadata(tmp_path / "lora" / name)
        assert (meta["rangefinder.base_model"], meta["rangefinder.base_model_revision"]) == (str(bare),
                                                                                              f"sha256:{sha256}")
    # The kohya file names it as sd-scripts does (train_network.py at 48d368f, lines 1206-1213): the file's name,
    # its sha256, and A1111's old hash, of the 64 KiB 1 MiB into the file (library/train_util.py `model_hash`).
    data = bare.read_bytes()
    assert len(data) > 0x110000  # the old hash reads a whole 64 KiB, not the empty tail of a short file
    kohya = read_metadata(tmp_path / "lora" / "lora_kohya.safetensors")
    assert {k: kohya.get(k) for k in ("ss_sd_model_name", "ss_new_sd_model_hash", "ss_sd_model_hash")} == {
        "ss_sd_model_name": "bare.safetensors", "ss_new_sd_model_hash": sha256,
        "ss_sd_model_hash": hashlib.sha256(data[0x100000:0x110000]).hexdigest()[:8]}


def test_a_folder_a_file_names_that_holds_another_family_s_model_is_passed_over(tiny_sdxl_dir, tmp_path, monkeypatch):
    """A file names the folder it was trained on from `~` (`~/models/sd15`); on the machine it was shared to, `~` is
    that user's home, and a folder of that name there held an SDXL model: the SD 1.x file was converted with its
    configs and failed deep in diffusers. It is passed over, as a folder that is not there is."""
    import shutil

    from safetensors.torch import save_file

    from rangefinder.models.loading import _single_file_config

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(tiny_sdxl_dir, tmp_path / "models" / "sd15", ignore=shutil.ignore_patterns("*.safetensors"))
    path = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(1)}, str(path),
              {"rangefinder.base_model": "~/models/sd15", "rangefinder.method": "full"})
    assert _single_file_config(path, ModelConfig(), "sdxl") == tmp_path / "models" / "sd15"  # its own family's
    assert _single_file_config(path, ModelConfig(), "sd1") is None


def test_a_single_file_s_conversion_is_keyed_by_its_config_folder_s_files_not_only_its_path(tiny_flux_dir, tmp_path):
    """A Flux transformer file is converted with the VAE, CLIP-L and T5 of the folder that gives its architecture (an
    SD3 file without its text encoders likewise, and every file with that folder's configs): the conversion was
    keyed by the folder's path, so the cached one, made with the weights a folder held before someone replaced them
    under the same path, was taken again without a word. Its key follows the folder's files (fingerprint.py)."""
    import shutil

    from safetensors.torch import save_file

    from rangefinder.models.loading import _single_file_key
    from tests.models.test_fingerprint import flip_byte, last_tensor_data_at

    config = Path(shutil.copytree(tiny_flux_dir, tmp_path / "flux"))
    path = tmp_path / "transformer.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    content, key = _single_file_key(path, config)
    assert _single_file_key(path, config) == (content, key)  # the same files: the conversion found again
    vae = config / "vae" / "diffusion_pytorch_model.safetensors"
    flip_byte(vae, last_tensor_data_at(vae))
    assert _single_file_key(path, config) != (content, key)
    assert _single_file_key(path, config)[0] == content  # the file's own sha256 (its revision) is the file's alone
    # A damaged header there is the config folder's problem, named by the setting that gave it, not model.base_model.
    vae.write_bytes(b"\x01")
    with pytest.raises(ConfigError, match=rf"^model\.single_file_config: {re.escape(str(vae))} is not a readable "):
        _single_file_key(path, config)


def test_a_single_file_config_of_another_family_is_refused_before_converting(tiny_model_dir, tiny_sdxl_dir, tmp_path):
    from rangefinder.formats.single_file import export_full

    bare = export_full(tiny_model_dir, tmp_path / "bare.safetensors")
    with pytest.raises(ConfigError, match=r"single_file_config: .* is a Stable Diffusion XL model but .* is a "
                                          r"Stable Diffusion 1.x/2.x checkpoint; pass a folder of the checkpoint's"):
        resolve_base_model(ModelConfig(base_model=str(bare), single_file_config=str(tiny_sdxl_dir),
                                       cache_dir=str(tmp_path / "cache")))


def _refuse_the_network() -> list[str]:
    """In a forked child: every connection and name lookup refused from now on; the list notes each one tried."""
    import socket

    tried: list[str] = []

    def refuse(*args, **kwargs):
        tried.append(repr(args[:2])[:200])
        raise OSError("this test allows no network")

    socket.socket.connect = socket.socket.connect_ex = refuse
    socket.getaddrinfo = refuse
    return tried


def _convert_offline_set_after_import(bare: Path, cache: Path, report) -> None:
    """In a forked child: convert `bare` with HF_HUB_OFFLINE set after huggingface_hub read it on its import, as a
    notebook sets it, every connection and name lookup refused and noted; sends (the outcome, what was tried)."""
    import os

    from huggingface_hub import constants

    tried = _refuse_the_network()
    constants.HF_HUB_OFFLINE = False  # as huggingface_hub read it on its import, before the variable was set
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        resolve_base_model(ModelConfig(base_model=str(bare), cache_dir=str(cache)))
        report.send(("converted", tried))
    except ConfigError as e:
        report.send((str(e), tried))


def test_a_bare_file_is_converted_without_a_connection_when_hf_hub_offline_is_set_after_import(tiny_model_dir,
                                                                                                 tmp_path):
    """huggingface_hub reads HF_HUB_OFFLINE once, on its import; rangefinder reads it when it loads (hub_offline).
    diffusers' from_single_file, for a file that names no architecture, downloads its family's configs though told
    local_files_only where none are cached, so a process that set the variable after the import (a notebook, a
    second main()) went to huggingface.co, though the run was offline. It asks the hub nothing now, and says in one
    line what to set."""
    import multiprocessing

    from rangefinder.formats.single_file import export_full

    bare = export_full(tiny_model_dir, tmp_path / "bare.safetensors")
    ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_convert_offline_set_after_import,
                                                        args=(bare, tmp_path / "cache", theirs))
    child.start()
    assert ours.poll(60), "the child sent nothing"
    outcome, tried = ours.recv()
    child.join(10)
    assert tried == [], tried
    assert outcome.startswith(f"model.base_model: cannot convert the checkpoint {bare}: "), outcome
    assert "HF_HUB_OFFLINE" in outcome and outcome.endswith(
        "set model.single_file_config to a local diffusers folder of the same architecture (diffusers otherwise "
        "fetches one from the hub)"), outcome
    assert "\n" not in outcome and not any((tmp_path / "cache").glob("base-models/*/model_index.json"))


def _convert_with_the_cache_set_after_import(bare: Path, hub: Path, elsewhere: Path, ours: Path, report) -> None:
    """In a forked child: convert `bare` with HF_HUB_CACHE (and HF_HUB_OFFLINE) set after huggingface_hub read the
    cache on its import as `elsewhere`, every connection refused and noted; sends (the outcome, what was tried)."""
    import os

    from huggingface_hub import constants

    tried = _refuse_the_network()
    constants.HF_HUB_CACHE = str(elsewhere)  # as huggingface_hub read it on its import, before the variable was set
    os.environ.update(HF_HUB_CACHE=str(hub), HF_HUB_OFFLINE="1", RANGEFINDER_CACHE=str(ours))
    try:
        report.send((str(resolve_base_model(ModelConfig(base_model=str(bare))).path), tried))
    except ConfigError as e:
        report.send((str(e), tried))


def test_a_bare_file_takes_its_architecture_from_the_hub_cache_set_after_import(tiny_model_dir, tmp_path):
    """huggingface_hub reads HF_HUB_CACHE once, on its import; rangefinder reads it when it loads (hub_cache_dir).
    diffusers' from_single_file, for a file that names no architecture, looks its family's configs up in the cache
    it is given, else in the one huggingface_hub read: a process that set the variable after the import (a notebook,
    a second main()) found a hub id's snapshot there but was refused the file's configs held in the same cache."""
    import multiprocessing

    from diffusers.loaders.single_file_utils import DIFFUSERS_DEFAULT_PIPELINE_PATHS

    from rangefinder.formats.single_file import export_full
    from tests.models.fake_hub import make_cached_repo

    bare = export_full(tiny_model_dir, tmp_path / "bare.safetensors")
    # The configs diffusers infers for an SD 1.x file, as `hf download` leaves them (the tiny model's, here).
    make_cached_repo(tmp_path / "hub", DIFFUSERS_DEFAULT_PIPELINE_PATHS["v1"]["pretrained_model_name_or_path"],
                     tiny_model_dir)
    (tmp_path / "elsewhere").mkdir()
    ours, theirs = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(
        target=_convert_with_the_cache_set_after_import,
        args=(bare, tmp_path / "hub", tmp_path / "elsewhere", tmp_path / "ours", theirs))
    child.start()
    assert ours.poll(60), "the child sent nothing"
    outcome, tried = ours.recv()
    child.join(10)
    assert tried == [], tried
    converted = Path(outcome)  # it said "cannot convert the checkpoint ...: Cannot find an appropriate cached
    assert converted.parent == tmp_path / "ours" / "base-models", outcome  # snapshot folder ..."
    assert (converted / "model_index.json").is_file() and not any((tmp_path / "elsewhere").iterdir())


def test_a_single_file_config_of_a_unet_family_for_a_transformer_file_names_both_families(tiny_flux_dir,
                                                                                          tiny_model_dir, tmp_path):
    """A Flux (or SD3) file with an SD 1.x folder as its architecture was told the folder "is not a diffusers folder
    (no transformer/)"."""
    from rangefinder.formats.flux_layout import export_flux_transformer

    bare = export_flux_transformer(tiny_flux_dir, tmp_path / "flux.safetensors", {})
    with pytest.raises(ConfigError, match=r"^model\.single_file_config: .* is a Stable Diffusion 1.x/2.x model but "
                                          r".* is a Flux.1 checkpoint; pass a folder of the checkpoint's own family$"):
        resolve_base_model(ModelConfig(base_model=str(bare), single_file_config=str(tiny_model_dir),
                                       cache_dir=str(tmp_path / "cache")))


def test_an_sd3_file_without_its_text_encoders_takes_them_from_its_single_file_config(tiny_sd3_dir, tmp_path):
    """Stability ships SD3.5's MMDiT and VAE as one file, its text encoders apart: with model.single_file_config the
    conversion stopped in diffusers' "Weights for this component appear to be missing in the checkpoint". The
    file's transformer and VAE are loaded, the folder's three encoders beside them."""
    from safetensors.torch import load_file, save_file

    from rangefinder.formats.single_file_sd3 import export_sd3_full

    whole = export_sd3_full(tiny_sd3_dir, tmp_path / "whole.safetensors", {})
    state = load_file(str(whole))
    transformer_vae = {k: v for k, v in state.items() if not k.startswith("text_encoders.")}
    assert len(transformer_vae) < len(state)
    save_file(transformer_vae, str(tmp_path / "sd3.5.safetensors"))
    sd = load_sd_components(ModelConfig(base_model=str(tmp_path / "sd3.5.safetensors"),
                                        single_file_config=str(tiny_sd3_dir), cache_dir=str(tmp_path / "cache")))
    for part in ("text_encoder", "text_encoder_2", "text_encoder_3"):
        theirs = type(getattr(sd, part)).from_pretrained(str(tiny_sd3_dir), subfolder=part).state_dict()
        assert all(torch.equal(v, theirs[k]) for k, v in getattr(sd, part).state_dict().items()), part


def test_the_weights_digest_tells_two_fine_tunes_of_one_architecture_apart(folder_parts):
    """The base model's digest reads the weights' values, not only their names and shapes: another fine-tune of the
    same architecture (differing in its first values, as every tensor of one does) is another base model."""
    import copy

    from rangefinder.models.loading import weights_digest

    unet = copy.deepcopy(folder_parts.unet)
    assert weights_digest({"unet": unet}) == weights_digest({"unet": folder_parts.unet})
    with torch.no_grad():
        next(unet.parameters()).view(-1)[0] += 1
    assert weights_digest({"unet": unet}) != weights_digest({"unet": folder_parts.unet})


def test_our_single_file_of_a_hub_model_loads_back_offline_through_the_cached_snapshot(offline_hub, tiny_model_dir,
                                                                                     folder_parts, tmp_path):
    """An export names its hub base model as "org/name@revision": loading the file back as a base model finds the
    architecture in that model's cached snapshot, with nothing fetched (it asked for model.single_file_config)."""
    from rangefinder.formats.single_file import export_full
    from rangefinder.formats.weights_file import export_metadata

    meta = export_metadata(method="full", base_model=resolve_base_model(ModelConfig(base_model=HUB_REPO)).source)
    path = export_full(tiny_model_dir, tmp_path / "from-hub.safetensors", meta)
    resolved = resolve_base_model(ModelConfig(base_model=str(path)))
    assert resolved.kind == "single_file" and (resolved.path / "model_index.json").is_file()
    assert _same_weights(load_sd_components(ModelConfig(base_model=str(path))).unet, folder_parts.unet)


@pytest.mark.parametrize("spelled", ["branch", "commit"])
def test_our_single_file_of_a_hub_model_at_a_revision_is_read_with_that_revision_s_config(tiny_model_dir, tmp_path,
                                                                                         spelled):
    """The export names the revision it was trained on ("org/name@v1", or "org/name" with the commit it resolved to
    as rangefinder.base_model_revision): loading the file back takes the architecture and scheduler from that
    revision's cached snapshot, not from main's, which has moved on to another config. The recorded commit was
    ignored: a run on "org/name" read main's."""
    import json
    import shutil

    from rangefinder.formats.single_file import export_full
    from rangefinder.formats.weights_file import export_metadata
    from tests.models.fake_hub import make_cached_repo

    cache = tmp_path / "hf-hub-cache"  # its own: the session's cache is shared by the other tests
    v1 = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("v1",))
    newer = Path(shutil.copytree(tiny_model_dir, tmp_path / "newer"))
    scheduler = newer / "scheduler" / "scheduler_config.json"
    scheduler.write_text(json.dumps({**json.loads(scheduler.read_text()), "timestep_spacing": "trailing"}))
    main = make_cached_repo(cache, HUB_REPO, newer, refs=("main",))
    assert main != v1
    named = (dict(base_model=f"{HUB_REPO}@v1") if spelled == "branch"
             else dict(base_model=HUB_REPO, base_model_revision=v1))
    path = export_full(tiny_model_dir, tmp_path / "from-v1.safetensors", export_metadata(method="full", **named))
    # model.cache_dir is the hub cache the snapshot is looked up in, and where the file is converted to.
    resolved = resolve_base_model(ModelConfig(base_model=str(path), cache_dir=str(cache)))
    converted = json.loads((resolved.path / "scheduler" / "scheduler_config.json").read_text())
    assert converted["timestep_spacing"] == "leading" != json.loads(scheduler.read_text())["timestep_spacing"]


def test_a_single_file_whose_trained_commit_left_the_cache_says_which_snapshot_it_reads_instead(tiny_model_dir,
                                                                                                tmp_path, capsys):
    """The commit a file's rangefinder.base_model_revision records is no longer in the cache: its architecture is read
    from main's snapshot, which may differ, and one warning line names the file, both commits and the fix. The
    fallback was silent."""
    from rangefinder.formats.single_file import export_full
    from rangefinder.formats.weights_file import export_metadata
    from tests.models.fake_hub import make_cached_repo

    cache = tmp_path / "hf-hub-cache"
    main = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("main",))
    gone = "0123456789abcdef" * 2 + "01234567"  # a commit the cache never held
    path = export_full(tiny_model_dir, tmp_path / "from-gone.safetensors",
                       export_metadata(method="full", base_model=HUB_REPO, base_model_revision=gone))
    resolved = resolve_base_model(ModelConfig(base_model=str(path), cache_dir=str(cache)))
    assert (resolved.path / "model_index.json").is_file()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("rangefinder: warning:")]
    assert len(lines) == 1, lines
    for said in (str(path), gone, main, f"hf download {HUB_REPO} --revision {gone}", "model.single_file_config"):
        assert said in lines[0], (said, lines[0])


def test_files_trained_on_the_embedded_model_name_it_as_runs_write_it(tiny_model_dir, folder_parts, tmp_path):
    """A run on the embedded model writes its name with its cache folder ("embedded tiny model (<folder>)"), which
    loading compared with the bare name: its model.safetensors given back as the base model was converted with an
    architecture looked up on the hub (unreachable offline), and its embedding said "pass that as the base model"."""
    from safetensors.torch import save_file

    from rangefinder.formats.single_file import export_full
    from rangefinder.formats.weights_file import export_metadata

    source = resolve_base_model(ModelConfig(cache_dir=str(tiny_model_dir.parent))).source
    assert source.startswith("embedded tiny model (")
    path = export_full(tiny_model_dir, tmp_path / "model.safetensors",
                       export_metadata(method="full", base_model=source))
    resolved = resolve_base_model(ModelConfig(base_model=str(path), cache_dir=str(tmp_path / "cache")))
    assert resolved.kind == "single_file"
    assert _same_weights(load_sd_components(ModelConfig(base_model=str(path), cache_dir=str(tmp_path / "cache"))).unet,
                         folder_parts.unet)
    embedding = tmp_path / "learned_embeds.safetensors"
    save_file({"emb_params": torch.zeros(1, 32)}, str(embedding),
              export_metadata(method="textual_inversion", base_model=source))
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=str(embedding)))
    assert f"it was trained on {under_home(source)}: leave model.base_model unset for it, and this file to" in \
        str(e.value)  # the file names the cache folder from ~ where it is under home


def test_hub_id_resolves_from_the_offline_cache_at_a_branch_tag_or_commit(offline_hub, folder_parts):
    cache, commit = offline_hub
    resolved = resolve_base_model(ModelConfig(base_model=HUB_REPO))
    assert resolved.kind == "hub" and resolved.source == f"{HUB_REPO}@main"
    assert resolved.path == cache / f"models--{HUB_REPO.replace('/', '--')}" / "snapshots" / commit
    for rev in ("v1", commit):
        assert resolve_base_model(ModelConfig(base_model=HUB_REPO, revision=rev)).path == resolved.path
    parts = load_sd_components(ModelConfig(base_model=HUB_REPO))
    assert parts.kind == "hub" and parts.source == f"{HUB_REPO}@main"
    for name in ("unet", "vae", "text_encoder"):
        assert _same_weights(getattr(parts, name), getattr(folder_parts, name)), name


def test_a_resolved_folder_is_loaded_without_resolving_again(offline_hub, tmp_path, monkeypatch):
    """What every step after the first does: the config carries the folder; the hub cache is not looked at."""
    resolved = resolve_base_model(ModelConfig(base_model=HUB_REPO))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    again = resolve_base_model(ModelConfig(base_model=HUB_REPO, resolved_dir=str(resolved.path)))
    assert again.path == resolved.path and again.kind == "hub"
    # A resolved_dir this step cannot see (another pod's disk) is resolved again, here from an empty cache.
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        resolve_base_model(ModelConfig(base_model=HUB_REPO, resolved_dir=str(tmp_path / "gone")))
    # One this step sees only in part (model_index.json, no parts: a copy cut short) is not trusted either.
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / "model_index.json").write_text((resolved.path / "model_index.json").read_text())
    with pytest.raises(ConfigError, match="not in the Hugging Face cache"):
        resolve_base_model(ModelConfig(base_model=HUB_REPO, resolved_dir=str(partial)))


def test_a_folder_s_variant_files_are_the_ones_loaded(tiny_model_dir, folder_parts, tmp_path):
    """model.variant loads a local folder's variant files (diffusion_pytorch_model.fp16.safetensors, as a saved or
    downloaded folder names them), not only a hub snapshot's."""
    import shutil

    folder = tmp_path / "variant"
    shutil.copytree(tiny_model_dir, folder)
    for weights in folder.glob("*/*.safetensors"):
        weights.rename(weights.with_name(weights.name.replace(".safetensors", ".fp16.safetensors")))
    parts = load_sd_components(ModelConfig(base_model=str(folder), variant="fp16"))
    assert parts.kind == "folder" and _same_weights(parts.unet, folder_parts.unet)
    # Variant files alone need no model.variant: the one variant there is loaded (diffusers and transformers load
    # them only when told it; every step after the first, sampling and restoring a checkpoint, was told none).
    parts = load_sd_components(ModelConfig(base_model=str(folder)))
    assert _same_weights(parts.unet, folder_parts.unet) and _same_weights(parts.text_encoder, folder_parts.text_encoder)


def test_a_part_without_the_weights_asked_for_names_the_part_and_the_variant_to_set(tiny_model_dir, tmp_path):
    """Two variants and no plain weights without model.variant, a variant the folder lacks, a part with no weights:
    diffusers and transformers said "no file named diffusion_pytorch_model.bin (or model.safetensors) found in
    directory" of the model's folder, naming neither the part nor model.variant."""
    import shutil

    fp16 = tmp_path / "fp16-only"
    shutil.copytree(tiny_model_dir, fp16)
    for weights in fp16.glob("*/*.safetensors"):
        weights.rename(weights.with_name(weights.name.replace(".safetensors", ".fp16.safetensors")))
    two = tmp_path / "fp16-and-bf16"
    shutil.copytree(fp16, two)
    for weights in two.glob("*/*.fp16.safetensors"):
        shutil.copy(weights, weights.with_name(weights.name.replace(".fp16.", ".bf16.")))
    cases = [
        (ModelConfig(base_model=str(two)), "holds only the bf16 and fp16 variants of its weights, and model.variant "
                                           "is unset; set model.variant to the one to train"),
        (ModelConfig(base_model=str(fp16), variant="fp61"), "has no 'fp61' variant of its weights (model.variant), "
                                                            "only fp16; set model.variant to one of those"),
        (ModelConfig(base_model=str(tiny_model_dir), variant="fp16"), "has no 'fp16' variant of its weights "
                                                                      "(model.variant), only the plain ones; leave "
                                                                      "model.variant unset"),
    ]
    for cfg, fix in cases:
        with pytest.raises(ConfigError) as e:
            load_sd_components(cfg)
        assert str(e.value).startswith(f"model.base_model: text_encoder/ of {cfg.base_model} ") and fix in str(e.value)
        assert "\n" not in str(e.value)
    cut = tmp_path / "no-unet-weights"
    shutil.copytree(tiny_model_dir, cut)
    (cut / "unet" / "diffusion_pytorch_model.safetensors").unlink()
    with pytest.raises(ConfigError, match=r"^model\.base_model: unet/ of .* holds no weights file .*fetch the model "
                                          r"again or pass a complete folder$"):
        load_sd_components(ModelConfig(base_model=str(cut)))


def test_hub_id_not_in_the_offline_cache_says_how_to_fill_it(offline_hub):
    cache, _ = offline_hub
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model="rangefinder-tests/not-downloaded", revision="v2"))
    msg = str(e.value)
    assert msg.startswith("model.base_model: hub model 'rangefinder-tests/not-downloaded' (revision 'v2')")
    assert "HF_HUB_OFFLINE is set" in msg and str(cache) in msg
    assert "hf download rangefinder-tests/not-downloaded --revision v2" in msg and "HF_TOKEN" in msg
    assert "\n" not in msg
    # So does the family's check before a run (hub_family), which reads model_index.json alone: not a fetch tried.
    from rangefinder.models.loading import hub_family

    with pytest.raises(ConfigError) as e:
        hub_family(ModelConfig(base_model="rangefinder-tests/not-downloaded", revision="v2"))
    assert str(e.value) == msg


def test_the_offline_message_s_hf_download_fetches_a_whole_diffusers_folder(offline_hub, tiny_model_dir):
    """The command the message gives, read by the hf CLI's own parser: every pattern is an --include (hf's --include
    takes one pattern a time; the ones after it would be file names, and hf then drops --include), and together they
    select model_index.json and every part of a diffusers folder."""
    import shlex

    import click
    from huggingface_hub.cli.hf import app
    from huggingface_hub.utils import filter_repo_objects

    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model="rangefinder-tests/not-downloaded"))
    command = str(e.value).split("pre-fill it with `", 1)[1].split("`", 1)[0]
    env, hf, verb, *args = shlex.split(command)
    assert env.startswith("HF_HUB_CACHE=") and (hf, verb) == ("hf", "download")
    download = app.get_command(click.Context(app), "download")
    download = getattr(download, "materialize", lambda: download)()  # hf loads its commands lazily
    params = download.make_context("download", args).params
    assert params["repo_id"] == "rangefinder-tests/not-downloaded" and not params["filenames"], params
    files = {str(p.relative_to(tiny_model_dir)) for p in tiny_model_dir.rglob("*") if p.is_file()}
    needed = {f for f in files if "/" in f} | {"model_index.json"}
    assert needed <= set(filter_repo_objects(files, allow_patterns=params["include"]))


def test_a_step_that_cannot_see_the_resolved_folder_loads_the_commit_resolved_not_the_branch(tmp_path, monkeypatch,
                                                                                             tiny_model_dir):
    """resolve-config resolved `main` to a commit and handed it on (model.resolved_revision); a later step that
    cannot see its folder (no shared volume) resolves again, after `main` moved upstream: it must load the commit the
    run was resolved to, which the run's MLflow records name, not the new head of the branch."""
    from tests.models.fake_hub import make_cached_repo

    cache = tmp_path / "hf-hub-cache"  # its own: the session's cache is shared by the other tests
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monday = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("main",))
    tuesday = make_cached_repo(cache, HUB_REPO, tiny_model_dir, refs=("main",), commit="7" * 40)  # main moved
    assert resolve_base_model(ModelConfig(base_model=HUB_REPO)).path.name == tuesday
    again = resolve_base_model(ModelConfig(base_model=HUB_REPO, resolved_dir="/not/on/this/node",
                                           resolved_revision=monday))
    assert (again.path.name, again.revision, again.source) == (monday, monday, f"{HUB_REPO}@main")
    # So it does where the config names the branch itself: the resolved commit comes before model.revision.
    named = resolve_base_model(ModelConfig(base_model=HUB_REPO, revision="main", resolved_dir="/not/on/this/node",
                                           resolved_revision=monday))
    assert (named.path.name, named.revision, named.source) == (monday, monday, f"{HUB_REPO}@main")


def test_revision_not_in_the_offline_cache_names_what_is_there(offline_hub):
    _, commit = offline_hub
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=HUB_REPO, revision="v9"))
    msg = str(e.value)
    assert msg.startswith(f"model.revision: 'v9' of hub model '{HUB_REPO}' is not in the Hugging Face cache")
    assert "refs main, v1" in msg and "--revision v9" in msg
    # Each snapshot is named by its whole commit, which model.revision takes: a short one was listed, and refused.
    listed = msg.split(" and snapshots ")[1].split(")")[0]
    assert listed == commit
    assert resolve_base_model(ModelConfig(base_model=HUB_REPO, revision=listed)).path.name == commit


def test_incomplete_hub_snapshot_names_the_missing_parts(offline_hub, tiny_model_dir, tmp_path, monkeypatch):
    from tests.models.fake_hub import make_cached_repo

    partial = tmp_path / "partial"
    (partial / "unet").mkdir(parents=True)
    for f in ("model_index.json",):
        (partial / f).write_bytes((tiny_model_dir / f).read_bytes())
    (partial / "unet" / "config.json").write_bytes((tiny_model_dir / "unet" / "config.json").read_bytes())
    cache = tmp_path / "cache"
    make_cached_repo(cache, "rangefinder-tests/partial", partial)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    # It said "a Stable Diffusion folder needs unet/, vae/, ...", of a snapshot the cache holds cut short.
    with pytest.raises(ConfigError, match=r"lacks vae/, text_encoder/, tokenizer/, scheduler/, which cannot be "
                                          r"fetched here \(HF_HUB_OFFLINE is set\); complete it with "
                                          rf"`HF_HUB_CACHE={cache} hf download rangefinder-tests/partial "):
        resolve_base_model(ModelConfig(base_model="rangefinder-tests/partial"))


def test_folder_without_model_index(tmp_path, tiny_model_dir):
    import shutil

    folder = tmp_path / "no-index"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "model_index.json").unlink()
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=str(folder)))
    assert str(e.value).startswith(f"model.base_model: {folder} is not a diffusers model folder (no model_index.json)")


@pytest.mark.parametrize("given", ["a part", "a hub cache folder", "a run's folder", "an adapter's folder"])
def test_a_folder_one_step_from_a_model_names_what_to_pass(given, tiny_model_dir, fake_hub_cache, tmp_path):
    """A model's unet/, the Hugging Face cache's models--org--name, a full fine-tune's run folder, a LoRA's or an
    embedding's folder: each was "not a diffusers model folder (no model_index.json)", with save_pretrained() to use."""
    import shutil

    cache, _ = fake_hub_cache
    if given == "a part":
        folder, says = tiny_model_dir / "unet", f"it is the unet/ part of the diffusers folder {tiny_model_dir}: pass"
    elif given == "a hub cache folder":
        folder = cache / f"models--{HUB_REPO.replace('/', '--')}"
        says = f"pass the hub id {HUB_REPO} (with HF_HUB_CACHE={cache}), or one of its snapshot folders"
    elif given == "a run's folder":
        folder = tmp_path / "run"
        shutil.copytree(tiny_model_dir, folder / "final")
        says = f"it is a run's folder: pass the model it delivered, {folder / 'final'}"
    else:
        folder = delivered_files(tiny_model_dir, "textual_inversion", tmp_path / "final")
        says = (f"it holds learned_embeds.safetensors, an adapter, which is trained on a base model and applied on "
                f"top of it; it was trained on {under_home(str(tiny_model_dir))}: pass that as the base model")
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=str(folder)))
    assert str(e.value).startswith(f"model.base_model: {folder} is not a diffusers model folder (no "
                                   "model_index.json); ")
    assert says in str(e.value) and "save_pretrained" not in str(e.value)


def test_files_that_are_not_stable_diffusion_checkpoints(tmp_path):
    from safetensors.torch import save_file

    lora = tmp_path / "adapter.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8)}, str(lora))
    with pytest.raises(ConfigError, match=r"is not a Stable Diffusion checkpoint .*looks like a LoRA"):
        resolve_base_model(ModelConfig(base_model=str(lora)))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not safetensors at all")
    with pytest.raises(ConfigError, match="is not a readable safetensors file"):
        resolve_base_model(ModelConfig(base_model=str(junk)))
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ConfigError, match=r"is not a \.safetensors checkpoint"):
        resolve_base_model(ModelConfig(base_model=str(notes)))


def test_an_inpainting_checkpoint_is_named_one_before_converting(tiny_model_dir, tmp_path):
    """An inpainting model's file (its UNet's first convolution takes the mask and the masked image beside the
    latents: 9 channels) was converted with a text-to-image architecture, and refused with diffusers' advice to pass
    ignore_mismatched_sizes=True."""
    from safetensors.torch import load_file, save_file

    from rangefinder.formats.single_file import export_full

    tensors = load_file(str(export_full(tiny_model_dir, tmp_path / "sd.safetensors")))
    conv_in = tensors["model.diffusion_model.input_blocks.0.0.weight"]
    tensors["model.diffusion_model.input_blocks.0.0.weight"] = torch.cat([conv_in, conv_in, conv_in[:, :1]], dim=1)
    save_file(tensors, str(tmp_path / "sd-inpainting.safetensors"))
    with pytest.raises(ConfigError, match=r"^model\.base_model: .*sd-inpainting\.safetensors is not a text-to-image "
                                          r"checkpoint: its UNet takes 9 input channels, an inpainting model's .* pass "
                                          r"the text-to-image checkpoint it was made from$"):
        resolve_base_model(ModelConfig(base_model=str(tmp_path / "sd-inpainting.safetensors"),
                                       single_file_config=str(tiny_model_dir), cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "cache").exists()  # refused before any conversion


@pytest.mark.parametrize("given", ["an embedding", "a VAE"])
def test_an_adapter_or_a_vae_file_as_the_base_model_is_named_with_what_to_pass(given, tiny_model_dir, tmp_path):
    """Our own embedding file, or a VAE alone, given as the base model: each "looks like an embedding, a VAE or another
    kind of file", and the embedding did not name the base model it was trained on, which its metadata holds."""
    from safetensors.torch import load_file, save_file

    from rangefinder.formats.single_file import export_full

    if given == "an embedding":
        path = delivered_files(tiny_model_dir, "textual_inversion", tmp_path / "final") / "learned_embeds.safetensors"
        says = (f"it looks like a textual-inversion embedding); it was trained on {under_home(str(tiny_model_dir))}: "
                "pass that as the base model, and this file to `rangefinder sample --checkpoints` to draw with it")
    else:
        whole = load_file(str(export_full(tiny_model_dir, tmp_path / "sd.safetensors")))
        path = tmp_path / "vae.safetensors"  # as VAE files are shipped: the autoencoder's own names
        save_file({k.removeprefix("first_stage_model."): v for k, v in whole.items()
                   if k.startswith("first_stage_model.")}, str(path))
        says = "it looks like a VAE alone); pass a whole SD checkpoint, a diffusers folder or a hub id"
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=str(path)))
    assert str(e.value) == (f"model.base_model: {path} is not a Stable Diffusion checkpoint (no "
                            f"model.diffusion_model.* UNet weights; {says}")


def test_pickle_checkpoints_are_refused_unread(tmp_path):
    ckpt = tmp_path / "model.ckpt"
    ckpt.write_bytes(b"\x80\x04 a pickle that must never be loaded")
    with pytest.raises(ConfigError, match=r"pickle checkpoint \(\.ckpt\), which can run code .* convert it to"):
        resolve_base_model(ModelConfig(base_model=str(ckpt)))


@pytest.mark.parametrize("protocol", ["zip", "legacy"])
def test_a_pickle_named_safetensors_is_refused_unread_as_a_pickle(protocol, tmp_path):
    """A .ckpt renamed .safetensors (torch.save's zip, or a legacy pickle) was "not a readable safetensors file ...;
    download it again"; it is named a pickle, from its first bytes, and nothing in it runs."""
    path, marker = tmp_path / "model.safetensors", tmp_path / "code-ran"
    torch.save({"state_dict": _RunsCode(marker)}, path, _use_new_zipfile_serialization=protocol == "zip")
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=str(path)))
    pickled = "a PyTorch zip file" if protocol == "zip" else "a pickle"
    assert str(e.value).startswith(f"model.base_model: {path} is {pickled}, not safetensors (a pickle checkpoint such "
                                   "as a .ckpt, renamed), which can run code when loaded, so it is refused unread")
    assert not marker.exists()


class _RunsCode:
    """Pickled, it calls os.system when unpickled: what a malicious .bin holds beside its tensors."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


@pytest.mark.parametrize("part, weights", [("text_encoder", "pytorch_model.bin"),
                                           ("unet", "diffusion_pytorch_model.bin")])
def test_pickle_weights_in_a_folder_are_read_tensors_only_and_code_is_refused(part, weights, tiny_model_dir,
                                                                              tmp_path):
    # A transformers part's refusal (torch's UnpicklingError) came out as a traceback telling the user that
    # weights_only=False "will likely succeed".
    import shutil

    from safetensors.torch import load_file

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    (safetensors_file,) = (folder / part).glob("*.safetensors")
    tensors = load_file(str(safetensors_file))
    safetensors_file.unlink()
    marker = tmp_path / "code-ran"
    torch.save({**tensors, "payload": _RunsCode(marker)}, folder / part / weights)
    with pytest.raises(ConfigError, match=r"^model\.base_model: .*") as e:
        load_sd_components(ModelConfig(base_model=str(folder)))
    assert not marker.exists()
    assert "\n" not in str(e.value) and "weights_only" not in str(e.value), str(e.value)
    # diffusers' refusal (the unet's) came inside an OSError of its own: "Unable to load weights from checkpoint file".
    assert f"{part}/ of {folder}" in str(e.value) and "refused unread" in str(e.value)
    # Tensors only, in the same file name, load as the safetensors did.
    torch.save(tensors, folder / part / weights)
    parts = load_sd_components(ModelConfig(base_model=str(folder)))
    assert all(torch.equal(v, tensors[k]) for k, v in getattr(parts, part).state_dict().items() if k in tensors)


def test_missing_paths_and_malformed_ids(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_base_model(ModelConfig(base_model=str(tmp_path / "nowhere.safetensors")))
    with pytest.raises(ConfigError, match="neither an existing path nor a valid hub id"):
        resolve_base_model(ModelConfig(base_model="org/bad name!"))


@pytest.mark.parametrize("url, instead", [
    ("https://huggingface.co/stable-diffusion-v1-5/stable-diffusion-v1-5/blob/main/v1-5-pruned-emaonly.safetensors",
     "pass its hub id, stable-diffusion-v1-5/stable-diffusion-v1-5, instead (model.revision for a branch or commit)"),
    ("https://civitai.com/api/download/models/12345",
     "download the file, then pass its path (a .safetensors file), or pass a hub id such as org/name"),
], ids=["hugging-face-page", "download-link"])
def test_a_url_is_named_a_url_with_what_to_pass(url, instead, tmp_path, monkeypatch):
    """A model's link was read as a path: "does not exist (relative to /the/working/folder)"."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=url))
    assert str(e.value) == f"model.base_model: {url} is a URL, which rangefinder does not download; {instead}"
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Online: the hub's own answers, from a loopback stand-in (HF_ENDPOINT), through huggingface_hub


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported with HF_HUB_OFFLINE set: no HTTP call can be made")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with FakeHubServer() as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        yield hub


def test_gated_repo_without_a_token_or_with_one_that_has_no_access(fake_hub, monkeypatch):
    cfg = ModelConfig(base_model=fake_hub.gated_repo)
    with pytest.raises(ConfigError) as e:
        resolve_base_model(cfg)
    msg = str(e.value)
    assert msg.startswith(f"model.base_model: hub model '{fake_hub.gated_repo}' is gated")
    assert "HF_TOKEN" in msg and "kubernetes.hf_token_secret" in msg
    # A token whose account has not accepted the licence: the file download is refused (403 GatedRepo).
    token = "hf_" + "x" * 34
    monkeypatch.setenv("HF_TOKEN", token)
    with pytest.raises(ConfigError, match="is gated") as e:
        resolve_base_model(cfg)
    assert token not in str(e.value)
    assert any("/resolve/" in r for r in fake_hub.requests), fake_hub.requests


def test_a_snapshot_of_model_index_json_alone_tells_the_family_and_is_completed_from_the_hub(fake_hub, tmp_path,
                                                                                           tiny_model_dir):
    """What hub_family leaves in the cache when it fetched the one file (`rangefinder train` reads the family before
    any weights are downloaded): the family is read there with no request, and resolving the model goes on to the
    hub to complete the snapshot (here a gated repo, so the hub's answer is the error), where it was refused as a
    folder lacking unet/, vae/, ... and the download never came."""
    from rangefinder.models.loading import hub_family
    from tests.models.fake_hub import make_cached_repo

    index_only = tmp_path / "index-only"
    index_only.mkdir()
    (index_only / "model_index.json").write_bytes((tiny_model_dir / "model_index.json").read_bytes())
    make_cached_repo(tmp_path / "hub", fake_hub.gated_repo, index_only)
    cfg = ModelConfig(base_model=fake_hub.gated_repo)
    assert hub_family(cfg) == "sd1" and fake_hub.requests == []
    with pytest.raises(ConfigError, match="is gated"):
        resolve_base_model(cfg)
    assert fake_hub.requests and all(fake_hub.gated_repo in r for r in fake_hub.requests), fake_hub.requests


def test_missing_repo_and_missing_revision_online(fake_hub):
    with pytest.raises(ConfigError, match=r"no hub model 'someone/nothing-here' \(or it is private"):
        resolve_base_model(ModelConfig(base_model="someone/nothing-here"))
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=fake_hub.gated_repo, revision=fake_hub.missing_revision))
    assert str(e.value).startswith(f"model.revision: '{fake_hub.missing_revision}' does not exist for hub model")


def test_unreachable_hub_fails_in_seconds_with_the_id(monkeypatch, tmp_path):
    """Nothing listens on the endpoint: one error naming the model, not diffusers' minute of retries."""
    import socket
    import time

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported with HF_HUB_OFFLINE set")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections to it are refused
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    t0 = time.monotonic()
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model="rangefinder-tests/no-such-model"))
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "'rangefinder-tests/no-such-model'" in msg and "cannot be reached" in msg and "hf download" in msg


def test_an_unreachable_hub_says_what_the_cache_holds_of_the_model(fake_hub_cache, tiny_model_dir, monkeypatch,
                                                                  tmp_path):
    """A misspelt revision, or a snapshot cut short, of a model in the cache, with the hub out of reach: each was told
    the model "is not in the Hugging Face cache", and to download what was there."""
    import shutil
    import socket

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        pytest.skip("huggingface_hub was imported with HF_HUB_OFFLINE set")
    cache, commit = fake_hub_cache
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: connections to it are refused
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=HUB_REPO, revision="mian"))
    assert str(e.value).startswith(f"model.revision: 'mian' of hub model '{HUB_REPO}' is not in the Hugging Face "
                                   f"cache {cache} (it holds refs main, v1 and snapshots {commit}) and the hub cannot "
                                   "be reached from here (")
    assert "set model.revision to one of those" in str(e.value) and "\n" not in str(e.value)

    from tests.models.fake_hub import make_cached_repo

    partial = tmp_path / "partial"
    shutil.copytree(tiny_model_dir, partial, ignore=shutil.ignore_patterns("vae"))
    own = tmp_path / "cache"  # the session's cache is shared by the other tests
    make_cached_repo(own, "rangefinder-tests/partial", partial)
    monkeypatch.setenv("HF_HUB_CACHE", str(own))
    with pytest.raises(ConfigError, match=r"^model\.base_model: the snapshot of hub model 'rangefinder-tests/partial' "
                                          r"at revision 'main' in the Hugging Face cache \(.*\) lacks vae/, which "
                                          r"cannot be fetched here \(the hub cannot be reached from here: .*\); "
                                          r"complete it with `HF_HUB_CACHE=.* hf download rangefinder-tests/partial "):
        resolve_base_model(ModelConfig(base_model="rangefinder-tests/partial"))


@pytest.mark.parametrize("variable", ["HF_HOME", "HF_HUB_CACHE"])
def test_a_hub_cache_variable_one_folder_off_names_the_folder_that_holds_the_model(variable, offline_hub, tmp_path,
                                                                                   monkeypatch):
    """HF_HOME set to the hub cache itself (it is HF_HOME/hub), or HF_HUB_CACHE to the folder above it: the model was
    "not in the Hugging Face cache", with a download to fill the wrong folder."""
    cache, _ = offline_hub
    home = tmp_path / "home"
    home.mkdir()
    (home / "hub").symlink_to(cache)
    monkeypatch.delenv("HF_HUB_CACHE")
    monkeypatch.setenv(variable, str(cache if variable == "HF_HOME" else home))
    with pytest.raises(ConfigError) as e:
        resolve_base_model(ModelConfig(base_model=HUB_REPO))
    holder = cache if variable == "HF_HOME" else home / "hub"
    assert f"(it is in {holder}: set HF_HUB_CACHE={holder}, the folder the models--* folders are in" in str(e.value)


def test_the_scheduler_names_taken_without_importing_diffusers_are_its_scheduler_classes():
    """check_scheduler_name takes KNOWN_SCHEDULERS (the demo's DDIM) without importing diffusers, so that a compile
    or resolve-config of the demo's config imports neither it nor torch: each must be a diffusers scheduler class,
    as a name outside them is checked to be."""
    import diffusers
    from diffusers import SchedulerMixin

    from rangefinder.config import demo_config
    from rangefinder.models.loading import KNOWN_SCHEDULERS, check_scheduler_name

    assert demo_config().sampling.scheduler in KNOWN_SCHEDULERS
    for name in KNOWN_SCHEDULERS:
        assert issubclass(getattr(diffusers, name), SchedulerMixin), name
    with pytest.raises(ConfigError, match="'UNet2DConditionModel' is not a diffusers scheduler class"):
        check_scheduler_name("UNet2DConditionModel")  # diffusers' class, no scheduler: outside the set, it is read


def test_a_folder_that_names_code_of_its_own_is_refused_before_anything_loads(tiny_model_dir, tmp_path):
    """Whoever can write the data volume (or owns a hub repo) can ship code in a model folder for diffusers or
    transformers to import: a part's `<library>.py` named in model_index.json (older diffusers releases import it
    unasked), an `auto_map` in a part's config (transformers' Auto classes ask on a terminal), a custom
    pipeline class. Such a folder resolved, trained, and met the code when sampling; now it is one line at resolve,
    also for a later step handed the folder as resolved, and no code of it runs."""
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    index = json.loads((folder / "model_index.json").read_text())
    marker = tmp_path / "code-ran"
    (folder / "unet" / "layers.py").write_text(f"open({str(marker)!r}, 'w')\n"
                                                "from diffusers import UNet2DConditionModel\n")
    (folder / "model_index.json").write_text(json.dumps({**index, "unet": ["layers", "UNet2DConditionModel"]}))
    for cfg in (ModelConfig(base_model=str(folder)), ModelConfig(resolved_dir=str(folder))):
        with pytest.raises(ConfigError) as e:
            resolve_base_model(cfg)
        assert str(e.value) == (f"model.base_model: {folder} loads parts with code shipped in the folder "
                                "(unet/layers.py), and rangefinder never runs code from a model; pass a model "
                                "saved by diffusers' own classes (its save_pretrained) without that code")
    assert not marker.exists()

    (folder / "model_index.json").write_text(json.dumps(index))
    tokenizer_config = json.loads((folder / "tokenizer" / "tokenizer_config.json").read_text())
    (folder / "tokenizer" / "tokenizer_config.json").write_text(json.dumps(
        {**tokenizer_config, "auto_map": {"AutoTokenizer": ["layers.Tokenizer", None]}}))
    with pytest.raises(ConfigError, match=r"code shipped in the folder \(tokenizer/tokenizer_config\.json \(auto_map"):
        resolve_base_model(ModelConfig(base_model=str(folder)))

    (folder / "model_index.json").write_text(json.dumps({**index, "_class_name": ["pipeline", "MyPipeline"]}))
    with pytest.raises(ConfigError, match=r"names a custom pipeline \['pipeline', 'MyPipeline'\], code shipped"):
        resolve_base_model(ModelConfig(base_model=str(folder)))


def test_a_full_model_s_file_finds_its_config_in_the_folder_it_names_under_home(tmp_path, monkeypatch):
    """A pipeline's steps name a folder base model as model.base_model spelt it, `~/...` unexpanded, and that is what
    its model.safetensors says it was trained on (rangefinder.base_model): given back as a base model, the folder
    was looked for under a folder named `~` in the working one, not found, and the file's architecture was fetched
    from the hub instead (offline: refused)."""
    from safetensors.torch import save_file

    from rangefinder.formats.weights_file import export_metadata
    from rangefinder.models.loading import _single_file_config

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "home" / "models" / "sd15" / "unet").mkdir(parents=True)
    path = tmp_path / "model.safetensors"
    save_file({"x": torch.zeros(1)}, str(path), export_metadata(method="full", base_model="~/models/sd15"))
    assert _single_file_config(path, ModelConfig()) == tmp_path / "home" / "models" / "sd15"
    # A name under the home of no user here (a file from another machine) names no folder, and raises nothing.
    save_file({"x": torch.zeros(1)}, str(path), {"rangefinder.base_model": "~rf-no-such-user/sd15"})
    assert _single_file_config(path, ModelConfig()) is None
