"""Aspect-ratio buckets: the bucket list, an image's bucket, and the resize and crop that put it there."""

from __future__ import annotations

import math

import numpy as np
import pytest
from PIL import Image

from rangefinder.config import DataConfig
from rangefinder.data.buckets import (
    BucketSettings,
    bucket_array,
    bucket_image,
    bucket_sizes,
    bucket_table,
    image_size,
    nearest_bucket,
    place,
)
from rangefinder.data.pixels import load_rgb, to_model_array

SD = BucketSettings(512, 64, 2.0)
TINY = BucketSettings(32, 8, 2.0)


@pytest.mark.parametrize("settings", [SD, TINY, BucketSettings(1024, 64, 4.0), BucketSettings(768, 64, 1.5)])
def test_buckets_have_about_the_square_area_step_sides_and_bounded_aspect(settings):
    sizes = bucket_sizes(settings)
    r, step = settings.resolution, settings.step
    assert (r, r) in sizes
    for w, h in sizes:
        assert w % step == 0 and h % step == 0
        assert w * h <= r * r  # never more pixels (memory) than the square
        assert w * h > r * r - step * max(w, h)  # the tallest height that fits: one step more would not
        assert max(w, h) / min(w, h) <= settings.max_aspect + 1e-9
        assert (h, w) in sizes  # portraits and landscapes alike


def test_a_bucket_exactly_at_max_aspect_is_kept():
    # 40x24 is 5:3 exactly: with max_aspect 5/3 it stays (the bound is inclusive), so the set is TINY's.
    assert bucket_sizes(BucketSettings(32, 8, 40 / 24)) == ((24, 40), (32, 32), (40, 24))
    assert bucket_sizes(BucketSettings(32, 8, 1.6)) == ((32, 32),)


def test_the_square_is_a_bucket_even_where_no_width_reaches_it():
    # 96 px at step 64: the width 64 gets the height 128 (the area allows 144), so the square comes only as itself.
    settings = BucketSettings(96, 64, 2.0)
    assert bucket_sizes(settings) == ((64, 64), (64, 128), (128, 64))
    assert nearest_bucket((500, 500), settings) == (64, 64)


def test_sd_buckets_at_512_px():
    assert bucket_sizes(SD) == ((384, 640), (448, 576), (512, 512), (576, 448), (640, 384))
    assert bucket_sizes(TINY) == ((24, 40), (32, 32), (40, 24))


def test_default_step_follows_the_resolution():
    assert DataConfig(resolution=512).effective_bucket_step() == 64
    assert DataConfig(resolution=1024).effective_bucket_step() == 64
    assert DataConfig(resolution=32).effective_bucket_step() == 8
    assert DataConfig(resolution=64).effective_bucket_step() == 16
    assert DataConfig(resolution=32, bucket_step=16).effective_bucket_step() == 16


@pytest.mark.parametrize("size, bucket", [
    ((3000, 4000), (448, 576)),  # a 3:4 portrait photo
    ((4000, 3000), (576, 448)),
    ((1920, 1080), (640, 384)),  # 16:9 -> 5:3, the widest
    ((6000, 2000), (640, 384)),  # 3:1 panorama: cropped to the widest bucket
    ((777, 777), (512, 512)),
    ((500, 530), (512, 512)),
    ((1470, 1000), (640, 384)),  # nearer 5:3 than 9:7 in log aspect; in w/h (kohya's measure) it is nearer 9:7
])
def test_each_image_goes_to_the_bucket_nearest_its_aspect(size, bucket):
    assert nearest_bucket(size, SD) == bucket
    w, h = size
    assert nearest_bucket((h, w), SD) == bucket[::-1]  # log aspect: a transpose goes to the transposed bucket
    assert min(abs(math.log(b[0] / b[1]) - math.log(w / h)) for b in bucket_sizes(SD)) == pytest.approx(
        abs(math.log(bucket[0] / bucket[1]) - math.log(w / h)))


@pytest.mark.parametrize("size", [(3000, 4000), (1920, 1080), (6000, 2000), (37, 29), (20, 41), (100, 33)])
def test_resize_covers_the_bucket_and_crops_only_the_overflow_evenly(size):
    for settings in (SD, TINY):
        p = place(size, settings)
        (bw, bh), (rw, rh), (left, top) = p.bucket, p.resized, p.crop
        assert rw >= bw and rh >= bh
        assert rw == bw or rh == bh  # one side fits exactly: the smallest scale that covers
        assert left == (rw - bw) // 2 and top == (rh - bh) // 2  # centred
        assert left == 0 or top == 0  # cropped along one side only
        assert abs(rw / rh - size[0] / size[1]) <= 1 / min(rw, rh) + 1e-9  # the aspect is kept to a pixel


def test_bucket_array_has_the_buckets_shape_and_matches_the_square_path_on_squares():
    img = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 90, 3), dtype=np.uint8), "RGB")
    arr = bucket_array(img, (40, 24))
    assert arr.shape == (3, 24, 40) and arr.dtype == np.float32 and -1 <= arr.min() <= arr.max() <= 1
    cropped, p = bucket_image(img, (40, 24))
    assert cropped.size == (40, 24) and p.resized == (43, 24) and p.crop == (1, 0)
    square = Image.fromarray(np.random.default_rng(1).integers(0, 256, (64, 64, 3), dtype=np.uint8), "RGB")
    # A square image in the square bucket is exactly what the square crop (bucketing off) gives.
    assert np.array_equal(bucket_array(square, (32, 32)), to_model_array(square, 32))


def test_bucket_image_cuts_the_overflow_off_both_ends_of_the_long_side():
    # Images that cover their bucket at scale 1: what is left is exactly the centre columns (rows) of the pixels.
    rng = np.random.default_rng(2)
    wide = Image.fromarray(rng.integers(0, 256, (32, 48, 3), dtype=np.uint8), "RGB")  # 48x32 into 40x32
    out, p = bucket_image(wide, (40, 32))
    assert (p.resized, p.crop) == ((48, 32), (4, 0))
    assert np.array_equal(np.asarray(out), np.asarray(wide)[:, 4:44])
    tall = Image.fromarray(rng.integers(0, 256, (48, 32, 3), dtype=np.uint8), "RGB")  # 32x48 into 32x40
    out, p = bucket_image(tall, (32, 40))
    assert (p.resized, p.crop) == ((32, 48), (0, 4))
    assert np.array_equal(np.asarray(out), np.asarray(tall)[4:44])


def test_center_crop_off_squashes_each_image_into_its_bucket():
    settings = BucketSettings.from_data_config(DataConfig(resolution=32, center_crop=False))
    assert settings is not None and settings.crop is False
    p = place((90, 50), settings)
    assert (p.bucket, p.resized, p.crop) == ((40, 24), (40, 24), (0, 0))  # the whole image, squashed
    cropping = BucketSettings.from_data_config(DataConfig(resolution=32))
    assert cropping is not None and place((90, 50), cropping).crop == (1, 0)  # the default cuts the overflow
    assert BucketSettings.from_data_config(DataConfig(resolution=32, bucketing=False)) is None


def test_image_size_reads_the_header_and_turns_with_exif(tmp_path):
    img = Image.new("RGB", (60, 20), (10, 200, 30))
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to view": the camera stored a portrait lying on its side
    img.save(tmp_path / "turned.jpg", exif=exif)
    img.save(tmp_path / "plain.png")
    assert image_size(tmp_path / "plain.png") == (60, 20)
    assert image_size(tmp_path / "turned.jpg") == (20, 60) == load_rgb(tmp_path / "turned.jpg").size


def test_bucket_table_counts_each_subset():
    train = [place(s, TINY) for s in [(48, 80), (80, 48), (80, 48), (64, 64)]]
    val = [place((30, 50), TINY)]
    assert bucket_table({"train": train, "val": val}) == [
        {"bucket": "24x40", "width": 24, "height": 40, "train": 1, "val": 1},
        {"bucket": "32x32", "width": 32, "height": 32, "train": 1, "val": 0},
        {"bucket": "40x24", "width": 40, "height": 24, "train": 2, "val": 0},
    ]


def test_bad_bucket_settings_name_the_field():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="bucket_step"):
        DataConfig(resolution=32, bucket_step=12)
    with pytest.raises(ValidationError, match="larger than data.resolution"):
        DataConfig(resolution=32, bucket_step=64)
    assert DataConfig(resolution=32, bucket_step=64, bucketing=False).bucketing is False  # not used: no error
    with pytest.raises(ValidationError, match="max_aspect"):
        DataConfig(max_aspect=0.5)
