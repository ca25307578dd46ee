"""Vision fixtures: byte-deterministic, pinned, and actually showing what their expected answers claim."""

from __future__ import annotations

import base64
import hashlib
import io
from dataclasses import replace

import numpy as np
import pytest
from PIL import Image

from glmquant.errors import GlmquantError
from glmquant.servecheck.fixtures import IMAGES, VIDEOS, MediaFixture
from glmquant.servecheck.png import encode_png

ALL = IMAGES + VIDEOS


@pytest.mark.parametrize("fixture", ALL, ids=lambda f: f.name)
def test_generation_is_byte_deterministic_and_pinned(fixture: MediaFixture) -> None:
    first, second = fixture.build(), fixture.build()
    assert first == second
    assert hashlib.sha256(first).hexdigest() == fixture.sha256
    assert fixture.data_url().split(",", 1)[1] == base64.b64encode(first).decode()


def test_a_changed_fixture_is_refused_before_use() -> None:
    tampered = replace(IMAGES[0], build=lambda: IMAGES[1].build())
    with pytest.raises(GlmquantError, match="text-A7K2: generated SHA-256 .* differs from the pinned"):
        tampered.data()


def rgb(fixture: MediaFixture) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(fixture.data())).convert("RGB")).astype(int)


def blobs(mask: np.ndarray) -> int:
    """Connected components (4-neighbour) of a boolean mask."""
    seen = np.zeros_like(mask)
    count = 0
    for y, x in zip(*np.nonzero(mask)):
        if seen[y, x]:
            continue
        count += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1] and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return count


def test_circle_images_show_their_answer() -> None:
    for fixture in IMAGES[2:]:
        pixels = rgb(fixture)[::4, ::4]  # subsampled: circles stay connected, the walk stays cheap
        red = (pixels[..., 0] > 150) & (pixels[..., 2] < 100)
        blue = (pixels[..., 2] > 150) & (pixels[..., 0] < 100)
        mask = red if fixture.expected["colour"] == "red" else blue
        assert blobs(mask) == fixture.expected["count"]
        assert not (blue if mask is red else red).any()


def test_text_images_differ_only_inside_the_text() -> None:
    a, b = rgb(IMAGES[0]), rgb(IMAGES[1])
    assert a.shape == b.shape == (336, 336, 3)
    rows, _ = np.nonzero((a != b).any(-1))
    assert rows.min() >= 126 and rows.max() < 126 + 84  # the 7-row, 12x-scaled glyph band
    assert set(np.unique(a)) == {0, 255}  # pure black on white, nothing antialiased


def test_png_encoder_round_trips_through_pil() -> None:
    image = np.random.default_rng(0).integers(0, 256, (70, 300, 3), dtype=np.uint8)  # > one stored block
    decoded = np.asarray(Image.open(io.BytesIO(encode_png(image))))
    assert np.array_equal(decoded, image)


def frames(fixture: MediaFixture) -> list[np.ndarray]:
    av = pytest.importorskip("av")
    with av.open(io.BytesIO(fixture.data())) as container:
        stream = container.streams.video[0]
        assert stream.codec_context.name == "mpeg4" and float(stream.average_rate) == 8
        return [f.to_ndarray(format="rgb24").astype(int) for f in container.decode(video=0)]


def square(frame: np.ndarray) -> tuple[float, str]:
    """Centre x of the coloured square and its colour name."""
    coloured = (np.abs(frame - 255).sum(-1)) > 150
    ys, xs = np.nonzero(coloured)
    r, _, b = frame[ys, xs].mean(0)
    return xs.mean(), "red" if r > b else "blue"


@pytest.mark.parametrize("fixture", VIDEOS, ids=lambda f: f.name)
def test_videos_show_their_answer(fixture: MediaFixture) -> None:
    decoded = frames(fixture)
    assert len(decoded) == 32 and decoded[0].shape == (224, 224, 3)
    (x0, c0), (x1, c1) = square(decoded[0]), square(decoded[-1])
    assert ("left_to_right" if x1 > x0 else "right_to_left") == fixture.expected["direction"]
    assert (c0, c1) == (fixture.expected["start_colour"], fixture.expected["end_colour"])
