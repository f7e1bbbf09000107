"""Where the bench scripts keep their raw numbers: one JSON file each under bench/results/ (or --out)."""
from __future__ import annotations

import json
import os
from typing import Any

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def write_results(path: str, result: Any) -> None:
    """Write ``result`` as indented JSON to ``path`` (its directory created if missing) and say where."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {path}")
