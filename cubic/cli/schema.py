"""`cubic schema space|cluster|workload [-o FILE]`: a file format as JSON Schema, for editors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer


def schema(
    kind: str = typer.Argument(..., help="space | cluster | workload"),
    output: Path | None = typer.Option(None, "--output", "-o", help="File to write [default: stdout]."),
) -> None:
    """Print the JSON Schema of a search space, cluster or workload file (an editor then completes and checks it)."""
    from cubic.space.schemas import KINDS
    from cubic.space.schemas import schema as make

    if kind not in KINDS:
        print(f"error: cubic schema: {kind!r} is not a format; choose one of {list(KINDS)}", file=sys.stderr)
        raise typer.Exit(2)
    text = json.dumps(make(kind), indent=1) + "\n"
    if output is None:
        sys.stdout.write(text)
        return
    try:
        output.write_text(text)
    except OSError as e:
        print(f"error: cubic schema: cannot write {output}: {e.strerror}", file=sys.stderr)
        raise typer.Exit(2) from None
    print(f"wrote the {kind} schema to {output}", file=sys.stderr)
