"""Write docs/configuration.md from the configuration tree (opendiloco_stream/config.py).

    python scripts/gen_config_docs.py            # rewrite the file
    python scripts/gen_config_docs.py --check    # exit 1 if it is out of date
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from opendiloco_stream.config_cli import config_reference

TARGET = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="only check that the file is up to date")
    args = p.parse_args()
    text = config_reference()
    if args.check:
        if not TARGET.exists() or TARGET.read_text() != text:
            print(f"{TARGET} is out of date: run python scripts/gen_config_docs.py", file=sys.stderr)
            return 1
        return 0
    TARGET.write_text(text)
    print(f"wrote {TARGET}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
