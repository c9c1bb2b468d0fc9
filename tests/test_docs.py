"""The docs run word for word: every command in README.md and docs/*.md, on CPU, in order.

Each document's code blocks run one after another in a fresh copy of the checkout's files
(``examples/``, ``tests/``, ...; nothing a command made there before), so a command that
reads a file no earlier command made fails here, as it would for a reader, and what the
commands write stays in the test's directory. Shell blocks
(fenced ``bash``/``sh`` or unlabelled, and indented blocks) run under ``bash -e``; fenced
``python`` blocks run as scripts; other languages (``json``, ``toml``) are data, not
commands. A block that cannot run on a CPU machine (a GPU, several GPUs, a downloaded
checkpoint, an install) says so in the document itself, on the line above it::

    <!-- docs-test: skip: needs 2 GPUs -->

and is skipped with that reason.

Every ``python`` and ``torchrun`` the commands start (torchrun's workers included) is a process
forked from one server that imported torch once (``forkserver.py``), not a new interpreter: the
same arguments, directory, environment, descriptors and exit codes, without the seconds of
start-up each of them cost on a 2-core CI machine.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL, PYTHON = ("", "bash", "sh", "shell"), ("python", "py")
MARK = re.compile(r"^<!--\s*docs-test:\s*skip:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)\s*$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # 1-based line of the block's first code line
    kind: str  # "shell", "python" or "data"
    code: str
    skip: str | None  # the reason given in the document, or None

    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The code blocks of a Markdown file, in order, each with the skip reason written above it."""
    lines = path.read_text().splitlines()
    out: list[Block] = []

    def reason(first: int) -> str | None:
        j = first - 1
        while j >= 0 and not lines[j].strip():
            j -= 1
        m = MARK.match(lines[j].strip()) if j >= 0 else None
        return m.group(1) if m else None

    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if m:
            end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(1)), None)
            assert end is not None, f"{path.name}:{i + 1}: code block never closed"
            lang = m.group(2).lower()
            kind = "shell" if lang in SHELL else "python" if lang in PYTHON else "data"
            out.append(Block(path.name, i + 2, kind, "\n".join(lines[i + 1:end]) + "\n", reason(i)))
            i = end + 1
            continue
        if lines[i].startswith("    ") and lines[i].strip() and (i == 0 or not lines[i - 1].strip()):
            end = i
            while end < len(lines) and (lines[end].startswith("    ") or not lines[end].strip()):
                end += 1
            code = "\n".join(line[4:] for line in lines[i:end]).strip() + "\n"
            out.append(Block(path.name, i + 1, "shell", code, reason(i)))
            i = end
            continue
        i += 1
    return out


def _workdir(tmp: Path) -> Path:
    """A fresh copy of the checkout's files (git's tracked files; without git, its folders less
    what ``.gitignore`` names): the commands write only here, never in the user's checkout."""
    import fnmatch
    import shutil

    try:
        listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
        files = [f for f in listed.decode().split("\0") if f and (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout (a source archive)
        rules = [ln.strip() for ln in (ROOT / ".gitignore").read_text().splitlines() if ln.strip() and ln[0] != "#"]

        def ignored(rel: Path) -> bool:  # .gitignore's rules as git reads them here: the last match wins
            out = any(part.startswith(".") for part in rel.parts)
            for rule in rules:
                pat = rule.lstrip("!").strip("/")
                if "/" in pat or rule.lstrip("!").startswith("/"):  # anchored at the root
                    depth = pat.count("/") + 1
                    hit = len(rel.parts) >= depth and fnmatch.fnmatch("/".join(rel.parts[:depth]), pat)
                else:
                    hit = any(fnmatch.fnmatch(part, pat) for part in rel.parts)
                out = (not rule.startswith("!")) if hit else out
            return out

        files = [str(f.relative_to(ROOT)) for f in ROOT.rglob("*") if f.is_file() and not ignored(f.relative_to(ROOT))]
    for f in files:
        if not f.startswith("."):
            (tmp / f).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / f, tmp / f)
    return tmp


def _env(cwd: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "RANK", "WORLD_SIZE",
                                                            "LOCAL_RANK", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = str(cwd) + os.pathsep + env.get("PYTHONPATH", "")  # the copy's code
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")  # python, torchrun of this venv
    env["CUDA_VISIBLE_DEVICES"] = ""  # the docs' CPU path, also on a machine with a GPU
    env["PET_MASTER_PORT"] = str(_free_port())  # torchrun's --master-port, so that a busy 29500 cannot fail a block
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(block: Block, cwd: Path, bin_dir: Path) -> subprocess.CompletedProcess:
    """``block`` in ``cwd``, its ``python`` and ``torchrun`` those of ``bin_dir`` (the fork server's)."""
    env = _env(cwd)
    env["PATH"] = str(bin_dir) + os.pathsep + env["PATH"]
    argv = ["bash", "-e", "-o", "pipefail", "-c", block.code] if block.kind == "shell" else [str(bin_dir / "python"), "-"]
    return subprocess.run(argv, input=None if block.kind == "shell" else block.code, cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_command_of_the_doc_runs_on_cpu_in_order(doc: Path, tmp_path: Path) -> None:
    from forkserver import shared_bin

    fork_bin = shared_bin()
    cwd = _workdir(tmp_path)
    ran = 0
    for block in blocks(doc):
        if block.kind == "data" or block.skip:
            continue
        out = _run(block, cwd, fork_bin)
        assert out.returncode == 0, (f"{block.where()} failed (exit {out.returncode}):\n{block.code}\n"
                                     f"--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}")
        ran += 1
    runnable = [b for b in blocks(doc) if b.kind != "data"]
    assert ran or not runnable or all(b.skip for b in runnable)


def test_every_skip_mark_sits_on_a_command_block() -> None:
    """A mark left behind when a block moved would silently skip the next one, or nothing."""
    for doc in DOCS:
        marks = [i + 1 for i, line in enumerate(doc.read_text().splitlines()) if MARK.match(line.strip())]
        marked = [b for b in blocks(doc) if b.skip]
        assert len(marks) == len(marked), f"{doc.name}: marks on lines {marks}, blocks skipped: {[b.where() for b in marked]}"
        assert all(b.kind != "data" for b in marked), [b.where() for b in marked if b.kind == "data"]


def test_the_readme_keeps_its_cpu_paths_runnable() -> None:
    """The README's commands that a CPU reader needs are not marked away: the entry points, training with
    checkpoints, and the tiny Hugging Face path (make, load, train)."""
    run = [b for b in blocks(ROOT / "README.md") if b.kind != "data" and not b.skip]
    text = "\n".join(b.code for b in run)
    for needle in ("braid.programs --import-torch-csv dualpipev.csv", "braid.viz sim.json", "braid.plan",
                   "--save ckpt", "--save-hf tiny-hf", "braid.hf.load(\"tiny-hf\"", "--hf tiny-hf"):
        assert needle in text, needle
    assert any(b.kind == "python" for b in run)


def test_the_parser_reads_fenced_indented_and_marked_blocks(tmp_path: Path) -> None:
    doc = tmp_path / "d.md"
    doc.write_text("text\n\n```bash\necho a\n```\n\n<!-- docs-test: skip: needs a GPU -->\n\n    echo b\n    echo c\n\n"
                   "```json\n{}\n```\n\n```python\nprint(1)\n```\n")
    got = [(b.line, b.kind, b.code, b.skip) for b in blocks(doc)]
    assert got == [(4, "shell", "echo a\n", None), (9, "shell", "echo b\necho c\n", "needs a GPU"),
                   (13, "data", "{}\n", None), (17, "python", "print(1)\n", None)]
