"""What every bench's JSON carries so that `python -m bench.report` can recognise it and say how it was made:
the bench's name (the report's key for the file's kind), the command line and when it ran."""
from __future__ import annotations

import shlex
import sys
from collections.abc import Sequence
from datetime import datetime, timezone
from typing import Any


def provenance(bench: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """`argv` is what the bench's main() parsed (None: this process's command line)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return {"bench": bench, "argv": args, "command": shlex.join(["python", "-m", f"bench.{bench}", *args]),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds")}
