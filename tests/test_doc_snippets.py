"""Every ```python block of README.md and docs/*.md runs on CPU.

The blocks of one file run in order in one fresh namespace (a later block may use names an
earlier one defined), in a temporary working directory. A block that cannot run on a CPU
machine is marked on the line right before its fence with ``<!-- snippet: skip (reason) -->``;
every skip must give a reason.
"""

from __future__ import annotations

import dataclasses
import pathlib
import re
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FILES = ["README.md"] + sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)")
_SKIP = re.compile(r"^\s*<!--\s*snippet:\s*skip\b(.*?)-->\s*$")
_REASON = re.compile(r"^\s*\((.*\S.*)\)\s*$")


@dataclasses.dataclass(frozen=True)
class Block:
    """One fenced python block: its first code line (1-based), source, and skip marker."""

    line: int
    source: str
    skip: str | None  # None: run it; otherwise the text after "skip" in the marker


def python_blocks(text: str) -> list[Block]:
    """The ```python blocks of a markdown text, in order.

    Args:
      text: markdown.
    Returns:
      One :class:`Block` per python fence (other fences are passed over).
    Raises:
      ValueError: a fence is not closed.
    """
    lines = text.splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        start = i
        i += 1
        body = []
        while i < len(lines) and not lines[i].strip().startswith(fence):
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i])
            i += 1
        if i == len(lines):
            raise ValueError(f"line {start + 1}: code fence {fence!r} is never closed")
        i += 1
        if lang != "python":
            continue
        skip = _SKIP.match(lines[start - 1]) if start > 0 else None
        blocks.append(Block(start + 2, "\n".join(body) + "\n", skip.group(1) if skip else None))
    return blocks


def _stray_skips(text: str) -> list[int]:
    """Lines of skip markers that are not right before a python fence."""
    lines = text.splitlines()
    bad = []
    for n, line in enumerate(lines):
        if _SKIP.match(line):
            nxt = _FENCE.match(lines[n + 1]) if n + 1 < len(lines) else None
            if not nxt or nxt.group(3) != "python":
                bad.append(n + 1)
    return bad


def test_block_parser():
    text = (
        "x\n```python\na = 1\n```\n```bash\nls\n```\n"
        "<!-- snippet: skip (needs a GPU) -->\n```python\nb = 2\n```\n"
    )
    blocks = python_blocks(text)
    assert [b.line for b in blocks] == [3, 10]
    assert blocks[0].source == "a = 1\n" and blocks[0].skip is None
    assert _REASON.match(blocks[1].skip).group(1) == "needs a GPU"
    assert _stray_skips(text) == []
    assert _stray_skips("<!-- snippet: skip (x) -->\ntext\n") == [1]
    with pytest.raises(ValueError, match="never closed"):
        python_blocks("```python\na = 1\n")


@pytest.mark.parametrize("path", FILES)
def test_skips_have_reasons(path):
    text = (ROOT / path).read_text()
    for b in python_blocks(text):
        if b.skip is not None:
            assert _REASON.match(b.skip), (
                f"{path}:{b.line - 1}: a skip marker needs a reason: "
                "<!-- snippet: skip (why this block cannot run on a CPU machine) -->"
            )
    assert not _stray_skips(text), (
        f"{path}: skip markers not right before a ```python fence at lines {_stray_skips(text)}"
    )


@pytest.mark.parametrize("path", FILES)
@pytest.mark.slow
def test_snippets_run(path, tmp_path, monkeypatch):
    blocks = [b for b in python_blocks((ROOT / path).read_text()) if b.skip is None]
    if not blocks:
        pytest.skip(f"{path} has no python block to run")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"snippets_{pathlib.Path(path).stem}"}
    for b in blocks:
        # Pad with blank lines so tracebacks give the line numbers of the markdown file.
        try:
            code = compile("\n" * (b.line - 1) + b.source, str(ROOT / path), "exec")
            exec(code, namespace)
        except Exception as e:
            tb = traceback.format_exc(limit=-3)
            pytest.fail(f"{path}: the block at line {b.line} raised {type(e).__name__}\n{tb}")
