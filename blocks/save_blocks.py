"""Save the block documents in this folder to the current Prefect server.

    python blocks/save_blocks.py            # every *.json here
    python blocks/save_blocks.py local-default.json

Each document names a block class of ``prefect_sgpu.blocks``, a block name and its
field values. Saving is idempotent (overwrite). Nothing is provisioned: blocks are
configuration only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect_sgpu import blocks

HERE = Path(__file__).resolve().parent


def save(path: Path) -> str:
    doc = json.loads(path.read_text())
    cls = getattr(blocks, doc["block_type"])
    cls(**doc["values"]).save(doc["name"], overwrite=True)
    return f"{cls.get_block_type_slug()}/{doc['name']}"


def main(argv: list[str]) -> None:
    paths = [HERE / a for a in argv] if argv else sorted(HERE.glob("*.json"))
    for path in paths:
        print(f"saved {save(path)}")


if __name__ == "__main__":
    main(sys.argv[1:])
