"""The largest inputs braid takes: every file kind's size and nesting, every count's range.

A real input sits far inside these bounds; beyond them a file is damaged or chosen to
exhaust the machine, and a number is a typo that would run for hours or fill the memory.
Either is refused in one line before it is parsed or any work starts: files by
:mod:`braid.io.inputs` (each reader names the :class:`FileLimit` of its kind), flags by
:func:`braid.io.cli.check_counts`, model shapes (a preset's overrides, a Hugging Face
``config.json``) by :func:`check_shape`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

MiB = 1 << 20
GiB = 1 << 30


@dataclass(frozen=True, slots=True)
class FileLimit:
    """At most ``bytes`` bytes, nested at most ``depth`` levels (arrays, objects, inline tables) in ``syntax``
    (``None``: not scanned for nesting)."""

    bytes: int
    depth: int = 0
    syntax: Literal["json", "jsonl", "toml"] | None = None


# A run file is flat (key = value, lists of values); the JSON files braid reads are records a few levels
# deep. Sizes: the largest real file of each kind is well below (a 400B model's safetensors index: 0.2 MiB;
# the largest tokenizer.json on the Hub: about 35 MiB; a simulated trace of p=16, m=256: about 45 MiB), and
# what a parser makes of them stays within about 2 GB (JSON of empty objects: about 20x its size).
RUN_FILE = FileLimit(1 * MiB, 8, "toml")
RECORD = FileLimit(16 * MiB, 32, "json")  # config.json, tokenizer_config.json, safetensors index, checkpoint records
COST_FILE = FileLimit(16 * MiB, 32, "json")
MEASUREMENTS = FileLimit(64 * MiB, 32, "json")  # braid.bench --capture sets
TRACE_FILE = FileLimit(64 * MiB, 32, "json")  # parsed, about 8x in memory
TORCH_CSV = FileLimit(16 * MiB)
TOKENIZER = FileLimit(96 * MiB, 64, "json")
DATA_FILE = FileLimit(64 * GiB, 64, "jsonl")  # read by ``datasets`` in blocks; JSON lines scanned for nesting first
DATA_SCAN = FileLimit(256 * MiB)  # a JSON lines file read whole to name its first bad line

MAX_TRACE_EVENTS = 500_000  # events of one trace file (the viewer keeps each, about 2 kB, in memory)
# A trace's expert load (``meta.expert_load``): the largest MoE models have a few hundred experts per layer
# (DeepSeek-V3: 256) and under a hundred MoE layers; a count is a JSON-exact whole number.
MAX_EXPERTS = 1 << 14
MAX_EXPERT_LOAD_CELLS = 1 << 20  # MoE layers x experts
MAX_ROUTED_ROWS = 1 << 53

# -- counts ---------------------------------------------------------------------------------------
# Programs grow as p x m (about 14 p m instructions for the two-chunk schedules; p=32, m=256 compiles in
# about 2 s): beyond these a command would work for minutes before it could answer.
MAX_PP = 1024
MAX_MBS = 16384
MAX_PM = 1 << 16

# The largest value of a count flag a real job can need (the largest models have about 130 layers, 128
# attention heads, a 26k hidden size and a 256k vocabulary; the longest trained sequences are about 1M tokens).
COUNT_LIMITS: dict[str, int] = {
    "tp": 1024, "dp": 1 << 20, "ep": 1 << 20, "cp": 1024, "hp": 1024, "chunks": 64, "gpus_per_node": 1024,
    "seq": 1 << 24, "micro_batch_size": 1 << 16, "image_size": 1 << 16,
    "visual_token_budget": 1 << 24,
    "steps": 100_000_000, "warmup": 100_000_000, "save_every": 100_000_000, "keep_checkpoints": 100_000,
    "iters": 1_000_000, "rounds": 100_000,
}
# The largest plan a schedule file may describe (the fields of braid.core.torch_format.PlanLimits), from the above.
PLAN_FILE_LIMITS = {"ranks": MAX_PP, "micro_batches": MAX_MBS, "product": MAX_PM,
                    "stages_per_rank": COUNT_LIMITS["chunks"]}
MAX_LAYERS = 1024
MAX_CTAS = 64  # thread blocks of one NCCL kernel (NCCL's MAXCHANNELS: config.maxCTAs above it is an error)
MAX_TIMEOUT_S = 86_400  # a communication timeout (s): a day
SHAPE_LIMITS: dict[str, int] = {
    "layers": MAX_LAYERS, "hidden": 1 << 18, "heads": 1 << 12, "kv_heads": 1 << 12, "ffn": 1 << 20,
    "vocab": 1 << 23, "vocab_size": 1 << 23,
}


def count_error(name: str, value: int | None, *, low: int = 1) -> str | None:
    """The refusal of a count ``--name value`` outside ``[low, COUNT_LIMITS or SHAPE_LIMITS[name]]``, or None."""
    if value is None:
        return None
    flag = "--" + name.replace("_", "-")
    if value < low:
        return f"{flag} must be {'a positive integer' if low == 1 else f'>= {low}'}, got {value}"
    high = COUNT_LIMITS.get(name, SHAPE_LIMITS.get(name))
    if high is not None and value > high:
        return f"{flag} {value}: at most {high:,} (more than a real job needs)"
    return None


def check_shape(shape: dict[str, int | None], where: str) -> None:
    """``ValueError`` (``where: ...``) for a model size beyond :data:`SHAPE_LIMITS` (layers, hidden, ...)."""
    for name, value in shape.items():
        high = SHAPE_LIMITS.get(name)
        if high is not None and isinstance(value, int) and value > high:
            raise ValueError(f"{where}: {name} {value:,}: at most {high:,} (more than any real model)")
