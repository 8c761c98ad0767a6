"""The three examples of docs/logra.md run as printed."""

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

DOC = Path(__file__).resolve().parents[1] / "docs" / "logra.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_three_examples():
    assert len(BLOCKS) == 3


@pytest.mark.parametrize("index", range(3))
def test_example_runs(index, capsys):
    exec(compile(BLOCKS[index], f"docs/logra.md[{index}]", "exec"), {"__name__": "__doc__"})
    assert capsys.readouterr().out.strip()
