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


def _grey_levels(path):
    rgb = np.asarray(load_rgb(path)).astype(int)
    assert rgb.ndim == 3 and rgb.shape[2] == 3
    assert (rgb[..., 0] == rgb[..., 1]).all() and (rgb[..., 1] == rgb[..., 2]).all()  # still grey
    return rgb[..., 0]


def test_16_bit_greyscale_png_keeps_its_tones(tmp_path):
    # A 16-bit greyscale PNG opens as "I;16"; PIL's own convert("RGB") clips 0..65535 to 0..255 (almost all white).
    # 49151 is 191.25 of 255: scaled by 255/65535 it is 191, shifted down a byte (/ 256) it would be 192.
    values = np.array([[0, 257 * 64, 32768, 49151, 65535]], dtype=np.uint16)
    Image.fromarray(values).save(tmp_path / "grey16.png")
    with Image.open(tmp_path / "grey16.png") as im:
        assert im.mode.startswith("I;16")  # the probe's case, not some other mode
    assert _grey_levels(tmp_path / "grey16.png").tolist() == [[0, 64, 128, 191, 255]]


def test_other_wide_and_odd_modes_convert_as_viewers_show_them(tmp_path):
    from rangefinder.data.pixels import _to_8bit

    # "I" (32-bit int, what older Pillows open 16-bit PNGs as) and "F" (float) are scaled, not clipped.
    as_i = _to_8bit(Image.fromarray(np.array([[0, 32768, 65535]], dtype=np.int32), "I"))
    assert np.asarray(as_i).tolist() == [[0, 128, 255]]
    as_i8 = _to_8bit(Image.fromarray(np.array([[0, 100, 255]], dtype=np.int32), "I"))  # 8-bit values in an "I"
    assert np.asarray(as_i8).tolist() == [[0, 100, 255]]
    as_f = _to_8bit(Image.fromarray(np.array([[0.0, 0.5, 1.0]], dtype=np.float32), "F"))
    assert np.asarray(as_f).tolist() == [[0, 128, 255]]

    # Palette with a transparent index, and grey + alpha: transparent parts on white, opaque ones as stored.
    pal = Image.new("P", (2, 1))
    pal.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    pal.putdata([0, 1])
    pal.save(tmp_path / "pal.png", transparency=0)
    assert np.asarray(load_rgb(tmp_path / "pal.png")).tolist() == [[[255, 255, 255], [255, 0, 0]]]
    la = Image.new("LA", (2, 1))
    la.putdata([(0, 0), (0, 255)])
    la.save(tmp_path / "la.png")
    assert np.asarray(load_rgb(tmp_path / "la.png")).tolist() == [[[255, 255, 255], [0, 0, 0]]]

    # Bilevel and CMYK (a print-shop JPEG): black stays black, paper stays white.
    bw = Image.new("1", (2, 1))
    bw.putdata([0, 1])
    bw.save(tmp_path / "bw.png")
    assert _grey_levels(tmp_path / "bw.png").tolist() == [[0, 255]]
    cmyk = Image.new("CMYK", (16, 8), (0, 0, 0, 0))
    cmyk.paste((0, 0, 0, 255), (8, 0, 16, 8))
    cmyk.save(tmp_path / "cmyk.jpg", quality=95)
    rgb = np.asarray(load_rgb(tmp_path / "cmyk.jpg")).astype(int)
    assert rgb[:, :4].min() > 240 and rgb[:, 12:].max() < 15


def _profile_with_red_and_blue_swapped() -> bytes:
    """An RGB ICC profile that is littlecms' sRGB with its red and blue primaries swapped and its description renamed:
    in it, the numbers (255, 0, 0) are sRGB's pure blue. Built from littlecms' own sRGB, so the test needs no profile
    file; a photo's Display P3 or Adobe RGB profile differs from sRGB the same way (other primaries), only less."""
    import io
    import struct

    from PIL import ImageCms

    data = bytearray(ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes())
    entries = {bytes(data[132 + 12 * i:136 + 12 * i]): 132 + 12 * i
               for i in range(struct.unpack(">I", data[128:132])[0])}
    red, blue = entries[b"rXYZ"], entries[b"bXYZ"]  # each entry: signature, offset, size: swap where they point
    data[red + 4:red + 12], data[blue + 4:blue + 12] = data[blue + 4:blue + 12], data[red + 4:red + 12]
    renamed = bytes(data).replace("sRGB".encode("utf-16-be"), "swap".encode("utf-16-be")).replace(b"sRGB", b"swap")
    assert "srgb" not in ImageCms.getProfileDescription(ImageCms.ImageCmsProfile(io.BytesIO(renamed))).lower()
    return renamed


def test_colours_in_another_colour_space_are_converted_to_srgb(tmp_path):
    """A file whose embedded ICC profile is not sRGB (a phone's Display P3, a camera's Adobe RGB) stores other numbers
    for the same colour; they were read as sRGB numbers. Here the profile's red is sRGB's blue, so the stored red
    must come out blue, in a PNG, a JPEG and with an alpha channel. An sRGB profile or none leaves the numbers as
    stored, bit for bit (the arrays, and the latents cached from them, of every other image stay what they were)."""
    from PIL import ImageCms

    swapped = _profile_with_red_and_blue_swapped()
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "tagged.png", icc_profile=swapped)
    Image.new("RGB", (8, 8), (255, 0, 0)).save(tmp_path / "tagged.jpg", icc_profile=swapped, quality=100)
    Image.new("RGBA", (8, 8), (255, 0, 0, 255)).save(tmp_path / "tagged-alpha.png", icc_profile=swapped)
    for name in ("tagged.png", "tagged.jpg", "tagged-alpha.png"):
        r, g, b = np.asarray(load_rgb(tmp_path / name)).astype(int)[4, 4]
        assert b > 240 and r < 15 and g < 15, (name, r, g, b)

    srgb = ImageCms.ImageCmsProfile(ImageCms.createProfile("sRGB")).tobytes()
    odd = (200, 100, 50)
    Image.new("RGB", (8, 8), odd).save(tmp_path / "srgb.png", icc_profile=srgb)
    Image.new("RGB", (8, 8), odd).save(tmp_path / "untagged.png")
    Image.new("RGB", (8, 8), odd).save(tmp_path / "broken.png", icc_profile=b"not a profile")
    for name in ("srgb.png", "untagged.png", "broken.png"):
        assert tuple(np.asarray(load_rgb(tmp_path / name))[4, 4]) == odd, name
