"""The requirements of kubeps and of the extras named, read from pyproject.toml alone, one per line.

    python images/requirements.py pyproject.toml [EXTRA ...] > requirements.txt

The Dockerfile installs them in a layer of their own before kubeps itself: that layer stays cached while only the
source changes (every commit), and is rebuilt when pyproject.toml changes.
"""

from __future__ import annotations

import sys
import tomllib


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        project = tomllib.load(f)["project"]
    extras = project.get("optional-dependencies", {})
    unknown = [name for name in argv[1:] if name not in extras]
    if unknown:
        print(f"requirements.py: {argv[0]} has no extra {', '.join(unknown)} (it has: {', '.join(sorted(extras))})",
              file=sys.stderr)
        return 2
    for requirement in [*project["dependencies"], *(r for name in argv[1:] for r in extras[name])]:
        print(requirement)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
