import json

import pytest
import torch
from PIL import Image

from rangefinder.data.captions import long_captions, movable_tags, shuffled_caption, split_tags
from rangefinder.training.captions import ShuffledCaptions


def test_tags_split_and_shuffle_with_the_first_ones_kept():
    text = "sks dog,  red collar, on grass ,, smiling"
    assert split_tags(text) == ["sks dog", "red collar", "on grass", "smiling"]
    assert movable_tags(text, 1) == 3 and movable_tags(text, 9) == 0
    assert shuffled_caption(text, 1, [2, 0, 1]) == "sks dog, smiling, red collar, on grass"
    with pytest.raises(ValueError):
        shuffled_caption(text, 1, [0, 0, 1])


def test_shuffled_captions_are_drawn_from_the_generator_and_keep_tokens_stay():
    captions = ["trigger, a, b, c, d, e", "no commas at all", "trigger, only"]
    sc = ShuffledCaptions(captions, keep_tokens=1, tokenize=None, encode=None, device=torch.device("cpu"))  # type: ignore[arg-type]
    draws = [sc.texts([0, 1, 2], torch.Generator().manual_seed(3)) for _ in range(2)]
    assert draws[0] == draws[1]  # the same generator state gives the same orders (what a resume restores)
    gen = torch.Generator().manual_seed(3)
    seen = {sc.texts([0], gen)[0] for _ in range(30)}
    assert len(seen) > 10  # the order changes from draw to draw
    for t in seen:
        assert t.startswith("trigger, ") and sorted(split_tags(t)) == sorted(split_tags(captions[0]))
    state = gen.get_state()
    assert sc.texts([1, 2], gen) == ["no commas at all", "trigger, only"]  # nothing to move: kept, nothing drawn
    assert torch.equal(gen.get_state(), state)


def test_long_captions_are_counted_and_listed_in_the_split_report(tmp_path, tiny_model_dir, capsys):
    from rangefinder.cli.main import main

    data = tmp_path / "data"
    data.mkdir()
    for i, text in enumerate(["a red circle", ", ".join(["a red circle on a blue background"] * 12)]):
        Image.new("RGB", (16, 16), (i, 0, 0)).save(data / f"{i}.png")
        (data / f"{i}.txt").write_text(text)
    assert long_captions([("x.png", "a b c")], lambda t: len(t.split()), 2) == [{"file_name": "x.png", "tokens": 3}]
    assert long_captions([("x.png", "a b")], lambda t: len(t.split()), 2) == []  # exactly the limit: all read
    out = tmp_path / "s"
    assert main(["split", str(data), "--out", str(out), "--resolution", "16", "--tokenizer", str(tiny_model_dir),
                 "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["long_captions"] == ["1.png: 95 tokens, over 75"]
    assert json.loads((out / "split.json").read_text())["long_captions"] == {
        "limit": 75, "count": 1, "files": [{"file_name": "1.png", "tokens": 95}]}
    assert main(["split", str(data), "--out", str(out), "--resolution", "16", "--json"]) == 0
    assert "give --tokenizer" in json.loads(capsys.readouterr().out)["long_captions"]


def test_split_counts_tokens_with_a_hub_id_s_tokenizer_as_train_takes_the_model(tmp_path, fake_hub_cache, capsys,
                                                                                  monkeypatch):
    """`--tokenizer org/name` (the model `train --model` is given) was "no tokenizer in org/name (We couldn't
    connect to 'https://huggingface.co' ...)" with the model in the offline cache."""
    from rangefinder.cli.main import main
    from tests.conftest import HUB_REPO

    cache, _ = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = tmp_path / "data"
    data.mkdir()
    Image.new("RGB", (16, 16)).save(data / "0.png")
    (data / "0.txt").write_text(", ".join(["a red circle on a blue background"] * 12))
    Image.new("RGB", (16, 16), (9, 9, 9)).save(data / "1.png")
    (data / "1.txt").write_text("a red circle")
    assert main(["split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16", "--tokenizer", HUB_REPO,
                 "--json"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["long_captions"] == ["0.png: 95 tokens, over 75"]


def test_a_tokenizer_saved_without_its_length_counts_against_clip_s_77(tiny_model_dir, tmp_path):
    """A tokenizer whose saved model_max_length is transformers' huge sentinel leaves 75 text tokens (CLIP's 77
    less its two special ones), read from tokenizer.json or, without it, through transformers."""
    import shutil

    from rangefinder.models.tokens import caption_token_counter

    folder = tmp_path / "tokenizer"
    shutil.copytree(tiny_model_dir / "tokenizer", folder)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**settings, "model_max_length": int(1e30)}))
    count, limit = caption_token_counter(folder)
    assert limit == 75 and count("a red circle") == 3
    (folder / "tokenizer.json").unlink()  # a slow tokenizer's vocab and merges alone
    count, limit = caption_token_counter(folder)
    assert limit == 75 and count("a red circle") == 3
