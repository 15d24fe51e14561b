"""The lake's file primitives on a full disk (a small tmpfs): a partition rewrite, a small atomic write and an
exclusive create that fail leave no staging folder or temporary file behind, and what was there stays."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from clawpipe import schemas, tables
from clawpipe.tables import LakeFS
from tests.support.disk import fill, small_disk


def _rows(n: int, fill_text: str = "x") -> pa.Table:
    rows = [
        {
            "run_id": "run",
            "iteration": 0,
            "rollout_id": f"r{i}",
            "status": "succeeded",
            "reward": 1.0,
            "error": fill_text,
        }
        for i in range(n)
    ]
    return pa.Table.from_pylist(rows, schemas.ROLLOUTS)


def _leftovers(root: Path) -> list[str]:
    return sorted(
        str(p.relative_to(root))
        for p in root.rglob("*")
        if p.name != "filler" and (tables.TMP_SUFFIX in p.name or (p.parent.name == tables.STAGING and p.is_dir()))
    )


def test_a_partition_rewrite_that_fills_the_disk_keeps_the_old_partition_and_leaves_no_staging(tmp_path: Path):
    with small_disk(tmp_path / "lake", 512) as lake:
        tables.replace_partition(lake, "rollouts", "run", 0, _rows(3))
        fill(lake, 4096)
        with pytest.raises(OSError):
            tables.replace_partition(lake, "rollouts", "run", 0, _rows(2000, "y" * 200))
        assert _leftovers(lake) == []
        staging = lake / tables.STAGING
        assert not staging.exists() or not any(staging.iterdir())
        got = tables.connect(lake).sql("select count(*) from rollouts").fetchall()
        assert got == [(3,)]


def test_small_atomic_writes_that_fill_the_disk_leave_no_temporary_file(tmp_path: Path):
    with small_disk(tmp_path / "lake", 256) as lake:
        fs = LakeFS(lake)
        fs.write_bytes("_manifest/a.json", b"{}")
        assert fs.create_exclusive("_manifest/b.json", b"{}")
        fill(lake, 0)
        big = b"z" * (64 * 1024)
        with pytest.raises(OSError):
            fs.write_bytes("_manifest/c.json", big)
        with pytest.raises(OSError):
            fs.create_exclusive("_manifest/d.json", big)
        assert _leftovers(lake) == []
        assert sorted(p.name for p in (lake / "_manifest").iterdir()) == ["a.json", "b.json"]
        assert fs.read_bytes("_manifest/a.json") == b"{}"
