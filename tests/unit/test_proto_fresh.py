"""The committed generated code must match the .proto files."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvdepot.proto.generate import PROTO_ROOT, generate


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    fresh = {p.name: p.read_text() for p in generate(tmp_path / "gen")}
    committed_dir = PROTO_ROOT / "gen"
    committed = {p.name: p.read_text() for p in committed_dir.iterdir() if p.is_file()}
    stale = sorted(n for n in fresh if committed.get(n) != fresh[n])
    extra = sorted(set(committed) - set(fresh))
    assert not stale and not extra, (
        f"generated code is stale ({stale}) or has extra files ({extra}): "
        "run `make proto` (python -m kvdepot.proto.generate) and commit the result"
    )
