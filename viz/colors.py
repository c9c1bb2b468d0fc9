"""Colours of the timeline, as in the paper's schedule figures (Sec. 3, Fig. 4-6).

Compute ops are coloured by kind (F, B, W) with a dark shade for chunk 0 and a light
shade for the last chunk (intermediate chunks of interleaved schedules are blended);
communication and host copies have one colour per kind.
"""

from __future__ import annotations

# (dark, light) per compute kind; one colour per other kind.
COMPUTE_SHADES: dict[str, tuple[str, str]] = {
    "F": ("#1f4e9c", "#8db3ea"),
    "B": ("#17753a", "#8fd4a0"),
    "W": ("#a65400", "#f5bf78"),
}
OTHER_COLORS: dict[str, str] = {
    "AR": "#c0392b",
    "SEND": "#6c3483",
    "RECV": "#b07cc6",
    "OFFLOAD": "#4d5d6c",
    "RELOAD": "#9aa9b0",
    "RS": "#e67e22",
    "AG": "#f1c40f",
    "OPT": "#34495e",
    "A2A": "#16a085",  # expert parallelism's all-to-all
}
BLOCK_OUTLINE = "#222222"
RANK_PALETTE: tuple[str, ...] = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf",
)  # fmt: skip


def _mix(a: str, b: str, t: float) -> str:
    ca = [int(a[i : i + 2], 16) for i in (1, 3, 5)]
    cb = [int(b[i : i + 2], 16) for i in (1, 3, 5)]
    return "#" + "".join(f"{round(x + (y - x) * t):02x}" for x, y in zip(ca, cb))


def block_color(kind: str, chunk: int | None, num_chunks: int) -> str:
    """Fill colour of one block: by kind, shaded by chunk for F/B/W (chunk 0 darkest)."""
    if kind in COMPUTE_SHADES:
        dark, light = COMPUTE_SHADES[kind]
        if chunk is None or num_chunks <= 1:
            return dark
        return _mix(dark, light, min(max(chunk, 0), num_chunks - 1) / (num_chunks - 1))
    if kind in OTHER_COLORS:
        return OTHER_COLORS[kind]
    raise ValueError(f"unknown event kind {kind!r}; valid kinds: {', '.join([*COMPUTE_SHADES, *OTHER_COLORS])}")


def rank_color(rank: int) -> str:
    return RANK_PALETTE[rank % len(RANK_PALETTE)]
