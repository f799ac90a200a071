"""The labelled image grid, as the sample grid (`grid.png`, rangefinder.sampling) and the samples during training
(`samples/update-N.png`, rangefinder.training.samples) write it: a header band of column labels, a band of row
labels, then square cells; small images are enlarged with nearest-neighbour pixels so tiny models stay readable."""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GridLayout:
    """Pixel geometry of grid.png: a header band of column labels, a band of row labels, then square cells."""

    cell: int  # displayed cell size; images are upscaled (nearest) when smaller, so tiny models stay readable
    label_width: int
    header_height: int
    rows: int
    cols: int

    @property
    def size(self) -> tuple[int, int]:
        return (self.label_width + self.cols * self.cell, self.header_height + self.rows * self.cell)

    def cell_box(self, row: int, col: int) -> tuple[int, int, int, int]:
        x = self.label_width + col * self.cell
        y = self.header_height + row * self.cell
        return (x, y, x + self.cell, y + self.cell)


def compose_grid(images: list[list[Any]], row_labels: list[str], col_labels: list[str], cell: int):
    """One PIL image: `images[row][col]` in cells, row labels on the left, column labels on top."""
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    wrap = max(8, cell // 7)
    col_lines = [textwrap.wrap(c, wrap) or [""] for c in col_labels]
    row_lines = [textwrap.wrap(r, 28) or [""] for r in row_labels]
    line_h = 12
    layout = GridLayout(
        cell=cell,
        label_width=max(160, 8 + 7 * max(len(line) for lines in row_lines for line in lines)),
        header_height=8 + line_h * max(len(lines) for lines in col_lines),
        rows=len(row_labels),
        cols=len(col_labels),
    )
    grid = Image.new("RGB", layout.size, "white")
    draw = ImageDraw.Draw(grid)
    for c, lines in enumerate(col_lines):
        x0 = layout.label_width + c * cell + 4
        for i, line in enumerate(lines):
            draw.text((x0, 4 + i * line_h), line, fill="black", font=font)
    for r, lines in enumerate(row_lines):
        y0 = layout.header_height + r * cell + 4
        for i, line in enumerate(lines[: max(1, (cell - 4) // line_h)]):
            draw.text((4, y0 + i * line_h), line, fill="black", font=font)
    for r, row in enumerate(images):
        for c, img in enumerate(row):
            x0, y0, _, _ = layout.cell_box(r, c)
            fitted = img.resize((cell, cell), Image.Resampling.NEAREST) if img.size != (cell, cell) else img
            grid.paste(fitted, (x0, y0))
    return grid, layout
