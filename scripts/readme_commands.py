"""Print README set-up command N (1: the main job, 2: the tests) exactly as the README shows it.

The commands are the lines after `# 1.` and `# 2.` in the first ```bash block under `## Install`.
CI runs what this prints, so the README cannot drift from what is tested.

    python scripts/readme_commands.py 1
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def commands(text: str) -> dict[str, str]:
    """{"1": command, "2": command} from the README's install block; ValueError if the layout changed."""
    install = text.split("\n## Install", 1)
    if len(install) != 2:
        raise ValueError("README.md has no '## Install' section")
    block = re.search(r"```bash\n(.*?)```", install[1], re.S)
    if block is None:
        raise ValueError("README.md's Install section has no ```bash block")
    found, lines = {}, block[1].splitlines()
    for i, line in enumerate(lines[:-1]):
        m = re.match(r"#\s*([12])\.", line)
        if m:
            found[m[1]] = lines[i + 1].strip()
    if sorted(found) != ["1", "2"] or not all(found.values()):
        raise ValueError(f"README.md's install block must hold '# 1.' and '# 2.' each followed by one command, found {sorted(found)}")
    return found


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in ("1", "2"):
        sys.exit("usage: python scripts/readme_commands.py 1|2")
    print(commands(README.read_text())[sys.argv[1]])
