"""``python -m bcg_plugin.patches [--write]``: print ``patches/README.md`` as the descriptors render it,
or write it in place."""

from __future__ import annotations

import sys

from bcg_plugin.patches import README_PATH, readme


def main(argv: list[str]) -> int:
    if argv not in ([], ["--write"]):
        print("usage: python -m bcg_plugin.patches [--write]", file=sys.stderr)
        return 2
    if argv:
        README_PATH.write_text(readme())
        print(f"wrote {README_PATH}")
    else:
        sys.stdout.write(readme())
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
