"""The measured figures of README.md and docs/ are what their stored files say.

Blocks between ``<!-- results: NAME -->`` markers are rendered from ``benchmarks/results/``
by ``benchmarks/render_results.py``; here they are rendered again and compared, and every
``benchmarks/results/`` path the documents name must exist.
"""

from __future__ import annotations

import glob
import importlib
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PATH = re.compile(r"benchmarks/results/([\w.{},*-]+)")


@pytest.fixture
def render_results(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    return importlib.import_module("render_results")


def _docs(render_results) -> dict[str, str]:
    return {doc: (ROOT / doc).read_text() for doc in render_results.DOCS}


def test_every_rendered_block_is_what_its_files_say(render_results) -> None:
    for doc, text in _docs(render_results).items():
        _, changed = render_results.render(text)
        assert not changed, f"{doc}: blocks {changed} differ from their files; run PYTHONPATH=. python benchmarks/render_results.py"


def test_every_block_is_in_a_document_once(render_results) -> None:
    names = [m["name"] for text in _docs(render_results).values() for m in render_results.BLOCK.finditer(text)]
    assert sorted(names) == sorted(render_results.BLOCKS), names


def test_a_figure_edited_by_hand_is_caught(render_results) -> None:
    """A block's figure changed by hand (85.72 -> 85.73 ms) or a row dropped is stale; the render restores it."""
    text = (ROOT / "docs" / "results.md").read_text()
    block = next(m for m in render_results.BLOCK.finditer(text) if m["name"] == "braided-overlap")
    assert "| 85.72 ms |" in block["body"]
    for edited in (text.replace("| 85.72 ms |", "| 85.73 ms |", 1),
                   text.replace(block["body"], "\n".join(block["body"].splitlines()[:-1]) + "\n")):
        fixed, changed = render_results.render(edited)
        assert changed == ["braided-overlap"] and fixed == text


def _expand(name: str) -> list[str]:
    """``a.{json,txt}`` -> ``a.json``, ``a.txt``; a trailing '.' or ',' is the sentence's."""
    name = name.rstrip(".,")
    m = re.search(r"\{([^}]*)\}", name)
    return [name[:m.start()] + alt + name[m.end():] for alt in m[1].split(",")] if m else [name]


def test_every_stored_file_the_documents_name_exists(render_results) -> None:
    named = {n for text in _docs(render_results).values() for p in PATH.findall(text) for n in _expand(p)}
    assert len(named) > 20, sorted(named)  # the documents do cite their files
    missing = sorted(n for n in named if not glob.glob(str(ROOT / "benchmarks" / "results" / n)))
    assert not missing, f"named in the docs but not in benchmarks/results/ (drop the figures or restore the files): {missing}"


def test_an_acceptance_summary_renders_its_printed_table(render_results, monkeypatch, tmp_path) -> None:
    """A stored ``summary.json`` of ``python -m braid.acceptance`` renders the table it printed, headed
    by the machine it ran on."""
    table = ["part             status    time/budget s  headline",
             "bench-tp2-pp1    passed          90/105  m=4 braid (braided_v, compiled units, CUDA graph) / best external 1.070x",
             "                                        memory m=4 braided_v: peak MiB per rank measured/predicted 1.0/1.0",
             "total 500 s of 540"]
    summary = {"device": "NVIDIA H100 80GB HBM3", "gpus": 2, "torch": "2.11.0", "nccl": "2.28.9", "table": table, "parts": []}
    (tmp_path / "acceptance_x.json").write_text(json.dumps(summary))
    monkeypatch.setattr(render_results, "RESULTS", tmp_path)
    assert render_results.acceptance("acceptance_x.json") == [
        "`acceptance_x.json` (2 x NVIDIA H100 80GB HBM3, torch 2.11.0, NCCL 2.28.9):", "", "```text", *table, "```"]
