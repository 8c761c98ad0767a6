"""The README's quickstart runs exactly as printed, and CI runs the README's test command."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs(capsys):
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    assert blocks, "README has no python block"
    exec(compile(blocks[0], "README.md", "exec"), {"__name__": "__readme__"})
    printed = capsys.readouterr().out.split("\n")
    assert [line.split()[0] for line in printed if line] == ["0", "1", "2"]


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/test.sh" in readme
    assert "bash scripts/test.sh" in (ROOT / ".ci" / "run").read_text()
