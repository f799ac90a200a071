import numpy as np
from PIL import Image

from rangefinder.data.pixels import from_model_array, load_rgb, to_model_array


def test_exif_orientation_is_applied_and_mode_is_rgb(tmp_path):
    # A 40x20 landscape stored with EXIF orientation 6 (rotate 90 deg clockwise to display): viewers show 20x40.
    img = Image.new("L", (40, 20), 0)
    img.paste(255, (0, 0, 10, 20))  # white band on the stored left edge
    exif = Image.Exif()
    exif[0x0112] = 6
    path = tmp_path / "rotated.jpg"
    img.save(path, exif=exif.tobytes(), quality=95)

    out = load_rgb(path)
    assert out.mode == "RGB"
    assert out.size == (20, 40)
    arr = np.asarray(out)
    # After a 90 deg clockwise turn the stored left edge is at the top.
    assert arr[:5].mean() > 200 and arr[-5:].mean() < 50


def test_transparent_pixels_become_white(tmp_path):
    img = Image.new("RGBA", (16, 16), (255, 0, 0, 0))
    path = tmp_path / "clear.png"
    img.save(path)
    assert np.asarray(load_rgb(path)).min() == 255


def test_to_model_array_shape_range_and_crop():
    img = Image.new("RGB", (64, 32), (0, 0, 0))
    img.paste((255, 255, 255), (16, 0, 48, 32))  # white centre square, black side bands
    arr = to_model_array(img, 16)
    assert arr.shape == (3, 16, 16) and arr.dtype == np.float32
    assert arr.min() >= -1 and arr.max() <= 1
    assert np.allclose(arr, 1.0)  # centre crop keeps only the white square
    squashed = to_model_array(img, 16, center_crop=False)
    assert squashed[:, :, 0].mean() < -0.9  # without cropping the black bands stay
    assert np.array_equal(np.asarray(from_model_array(arr)), np.full((16, 16, 3), 255, np.uint8))
