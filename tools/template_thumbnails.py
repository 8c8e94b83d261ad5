"""Draws the template browser's thumbnail of each bundled workflow: workflows/<name>.jpg beside workflows/<name>.json.

ComfyUI's frontend asks for exactly that file for a custom node's template and titles the card with the file name
(cut short when long), so each picture is a miniature of the workflow's graph, the pack's own nodes in MiniMax colours,
over the workflow's whole title, the heading of its note ("## <title>, with MiniMax Hotfix"). The browser lays a
"Node graph" badge over the top left corner and shows the picture at about 226 px, so nothing is drawn there and no
text is smaller than 26 px.

Run it with a Python that has Pillow (ComfyUI's own) after changing a workflow, and commit the pictures:

    python tools/template_thumbnails.py
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from PIL import Image, ImageColor, ImageDraw, ImageFont

WORKFLOWS = Path(__file__).resolve().parents[1] / "workflows"
SIDE = 512  # square like the core templates' thumbnails, twice the browser's largest size (256 px) for HiDPI
MARGIN = 28
GRAPH_BOX = (MARGIN, 84, SIDE - MARGIN, 296)
CAPTION_Y, TITLE_BOX = 318, (MARGIN, 356, SIDE - MARGIN, SIDE - 20)
BACKGROUND = "#1b1b1f"
TEXT = "#f2f2f2"
PACK_COLOURS = ("#e2167e", "#fe603c")  # the frontend's own MiniMax provider colours
NODE_BODY, NODE_TITLE, NODE_OUTLINE, WIDGET_ROW = "#353535", "#262626", "#4a4a4a", "#4b4b4b"
GROUP_COLOUR = "#3f789e"  # the frontend's default group colour
TITLE_HEIGHT = 30  # litegraph draws a node's title bar above its "pos"
LINK_COLOURS = {  # ComfyUI's dark palette
    "MODEL": "#b39ddb", "CLIP": "#ffd500", "VAE": "#ff6e6e", "CONDITIONING": "#ffa931", "LATENT": "#ff9cf9",
    "IMAGE": "#64b5f6", "NOISE": "#b0b0b0", "GUIDER": "#66ffff", "SAMPLER": "#ecb4b4", "SIGMAS": "#cdffcd",
}
OTHER_LINK = "#9a9a9a"
PACK_PREFIX = "MiniMaxHotfix"
JPEG_QUALITY = 80  # keeps each picture under 30 KB
NOTE_HEADING = re.compile(r"## (.+), with MiniMax Hotfix\n")
LINE_SPACING = 1.15


def font(size: int) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)  # Pillow's bundled font: the same pictures on every machine


def wrapped(draw: ImageDraw.ImageDraw, text: str, width: int, height: int,
            largest: int) -> tuple[list[str], ImageFont.FreeTypeFont]:
    """``text`` in lines of ``width`` pixels filling at most ``height``, in the largest size that fits."""
    for size in range(largest, 25, -2):
        lines, typeface = [], font(size)
        for word in text.split():
            candidate = f"{lines[-1]} {word}" if lines else word
            if lines and draw.textlength(candidate, font=typeface) <= width:
                lines[-1] = candidate
            else:
                lines.append(word)
        fits = all(draw.textlength(line, font=typeface) <= width for line in lines)
        if fits and len(lines) * size * LINE_SPACING <= height:
            return lines, typeface
    raise ValueError(f"title too long for a thumbnail: {text!r}")


def graph_transform(workflow: dict):
    """Maps canvas coordinates into GRAPH_BOX, keeping the aspect ratio and centring the graph."""
    boxes = [(node["pos"][0], node["pos"][1] - TITLE_HEIGHT, node["pos"][0] + node["size"][0],
              node["pos"][1] + node["size"][1]) for node in workflow["nodes"]]
    boxes += [(x, y, x + w, y + h) for x, y, w, h in (group["bounding"] for group in workflow.get("groups", []))]
    left, top = min(box[0] for box in boxes), min(box[1] for box in boxes)
    right, bottom = max(box[2] for box in boxes), max(box[3] for box in boxes)
    box_left, box_top, box_right, box_bottom = GRAPH_BOX
    scale = min((box_right - box_left) / (right - left), (box_bottom - box_top) / (bottom - top))
    offset_x = box_left + ((box_right - box_left) - (right - left) * scale) / 2 - left * scale
    offset_y = box_top + ((box_bottom - box_top) - (bottom - top) * scale) / 2 - top * scale
    return lambda x, y: (offset_x + x * scale, offset_y + y * scale)


def draw_graph(image: Image.Image, workflow: dict) -> None:
    to_card = graph_transform(workflow)
    overlay = Image.new("RGBA", image.size)
    shade = ImageDraw.Draw(overlay)
    for group in workflow.get("groups", []):
        x, y, w, h = group["bounding"]
        red, green, blue = ImageColor.getrgb(group.get("color", GROUP_COLOUR))[:3]
        shade.rounded_rectangle([to_card(x, y), to_card(x + w, y + h)], radius=4,
                                fill=(red, green, blue, 56), outline=(red, green, blue, 144))
    image.alpha_composite(overlay)

    draw = ImageDraw.Draw(image)
    nodes = {node["id"]: node for node in workflow["nodes"]}
    for _, origin, origin_slot, target, target_slot, link_type in workflow["links"]:
        start_node, end_node = nodes[origin], nodes[target]
        start = to_card(start_node["pos"][0] + start_node["size"][0], slot_y(start_node, origin_slot))
        end = to_card(end_node["pos"][0], slot_y(end_node, target_slot))
        reach = max(abs(end[0] - start[0]) * 0.5, 10)
        curve = [bezier(start, (start[0] + reach, start[1]), (end[0] - reach, end[1]), end, step / 24)
                 for step in range(25)]
        draw.line(curve, fill=LINK_COLOURS.get(link_type, OTHER_LINK), width=2, joint="curve")

    for node in workflow["nodes"]:
        x, y = node["pos"]
        w, h = node["size"]
        pack = node["type"].startswith(PACK_PREFIX)
        body = node.get("bgcolor", NODE_BODY)
        title = PACK_COLOURS[0] if pack else node.get("color", NODE_TITLE)
        draw.rounded_rectangle([to_card(x, y - TITLE_HEIGHT), to_card(x + w, y + h)], radius=3, fill=body,
                               outline=PACK_COLOURS[1] if pack else NODE_OUTLINE, width=2 if pack else 1)
        draw.rectangle([to_card(x + 2, y - TITLE_HEIGHT + 2), to_card(x + w - 2, y)], fill=title)
        for row_y in range(round(y) + 34, round(y + h) - 12, 34):  # widget rows: the miniature reads as nodes
            draw.line([to_card(x + 16, row_y), to_card(x + w * 0.7, row_y)], fill=WIDGET_ROW, width=1)


def slot_y(node: dict, slot: int) -> float:
    """Where litegraph draws a node's slot (20 px a row), kept inside the node for inputs that are widgets."""
    return node["pos"][1] + min(14 + 20 * slot, node["size"][1] - 10)


def bezier(p0, p1, p2, p3, t):
    mt = 1 - t
    return tuple(mt ** 3 * a + 3 * mt ** 2 * t * b + 3 * mt * t ** 2 * c + t ** 3 * d
                 for a, b, c, d in zip(p0, p1, p2, p3, strict=True))


def title(workflow: dict) -> str:
    (note,) = [node["widgets_values"][0] for node in workflow["nodes"] if node["type"] == "MarkdownNote"]
    return NOTE_HEADING.match(note).group(1)


def thumbnail(workflow: dict) -> Image.Image:
    image = Image.new("RGBA", (SIDE, SIDE), BACKGROUND)
    draw = ImageDraw.Draw(image)
    start, end = (ImageColor.getrgb(colour) for colour in PACK_COLOURS)
    for column in range(SIDE):  # a thin band in the MiniMax colours along the top
        share = column / (SIDE - 1)
        draw.line([(column, 0), (column, 5)],
                  fill=tuple(round(a + (b - a) * share) for a, b in zip(start, end, strict=True)))
    draw_graph(image, workflow)
    draw.text((MARGIN, CAPTION_Y), "MiniMax Hotfix", font=font(26), fill=PACK_COLOURS[0])
    left, top, right, bottom = TITLE_BOX
    lines, typeface = wrapped(draw, title(workflow), right - left, bottom - top, 46)
    for index, line in enumerate(lines):
        draw.text((left, top + index * typeface.size * LINE_SPACING), line, font=typeface, fill=TEXT)
    return image.convert("RGB")


def main() -> int:
    for path in sorted(WORKFLOWS.glob("*.json")):
        target = path.with_suffix(".jpg")
        thumbnail(json.loads(path.read_text(encoding="utf-8"))).save(
            target, "JPEG", quality=JPEG_QUALITY, optimize=True, progressive=True)
        print(f"{target.relative_to(WORKFLOWS.parent)}: {target.stat().st_size} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
