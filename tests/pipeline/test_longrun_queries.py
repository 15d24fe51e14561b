"""The pipeline's per-iteration lake queries open the files of their iteration, not every file the lake holds:
with 2 or 20 earlier iterations landed (and their trees built), the landed-batch check, the staleness count,
the harness summary, the example tree, the iteration's tree build and the trainer's read of its trees open
the same number of Parquet files. Files opened are
counted by the kernel (inotify), whoever opens them (DuckDB reads the files itself)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from clawpipe.config import Settings
from clawpipe.lake import land
from clawpipe.pipeline import overlap as ov
from clawpipe.pipeline.config import PipelineConfig
from clawpipe.pipeline.report import harness_details
from clawpipe.pipeline.stages import render_example_tree
from clawpipe.train.config import TrainConfig
from clawpipe.train.loading import load_trees
from clawpipe.trees.reconstruct import build_iteration
from clawpipe.trees.render import read_tree_nodes
from tests.lake import fixtures as fx

pytestmark = pytest.mark.slow

_IN_OPEN = 0x20
_IN_NONBLOCK = 0o4000
_EVENT = struct.Struct("iIII")
GROUPS, SAMPLES = 2, 2


class Opens:
    """Parquet files opened under a lake's partition folders, by table, while watched (Linux inotify)."""

    def __init__(self, lake: Path) -> None:
        self.libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        self.fd = self.libc.inotify_init1(_IN_NONBLOCK)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        self.table_of: dict[int, str] = {}
        for folder in lake.glob("*/run_id=*/iteration=*"):
            wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), _IN_OPEN)
            assert wd >= 0, os.strerror(ctypes.get_errno())
            self.table_of[wd] = folder.parent.parent.name

    def count(self, call: Callable[[], Any]) -> Counter[str]:
        self._drain()
        call()
        return self._drain()

    def _drain(self) -> Counter[str]:
        opened: Counter[str] = Counter()
        while True:
            try:
                data = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return opened
            pos = 0
            while pos < len(data):
                wd, _mask, _cookie, size = _EVENT.unpack_from(data, pos)
                name = data[pos + _EVENT.size : pos + _EVENT.size + size].rstrip(b"\0")
                pos += _EVENT.size + size
                if name.endswith(b".parquet"):
                    opened[self.table_of[wd]] += 1

    def close(self) -> None:
        os.close(self.fd)


def _tokenizer(folder: Path) -> Path:
    from tokenizers import Tokenizer, models

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"[UNK]": 0, **{f"t{i}": i for i in range(1, 200)}}
    Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")).save(str(folder / "tokenizer.json"))
    return folder


def _lake_of(home: Path, iterations: int, monkeypatch: pytest.MonkeyPatch) -> Settings:
    monkeypatch.setenv("CLAWPIPE_HOME", str(home))
    settings = Settings()
    cap = home / "cap"
    for it in range(iterations):
        ids = [(g, s) for g in range(GROUPS) for s in range(SAMPLES)]
        frames = [fx.record(iteration=it, rollout_id=f"r{it}-{g}-{s}", call_id=f"c{it}-{g}-{s}") for g, s in ids]
        fx.write_segment(cap / f"s-{it:06d}.seg", frames)
        rows = [fx.rollout_row(f"r{it}-{g}-{s}", iteration=it, group_id=f"g{g}", sample_idx=s) for g, s in ids]
        fx.write_results(cap, rows, batch=f"b{it}")
    land(cap, settings.lake_dir)
    for it in range(iterations):
        build_iteration(settings.lake_dir, "run1", it)
    return settings


def _opened_by_iteration_queries(home: Path, iterations: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    settings = _lake_of(home, iterations, monkeypatch)
    cfg = PipelineConfig(
        mode="async", groups=GROUPS, samples=SAMPLES, harnesses=[{"name": "chat-loop", "task_set": "guess"}]
    )  # type: ignore[list-item]
    tok = _tokenizer(home / "policy")
    opens = Opens(Path(settings.lake_dir))
    out: dict[str, Any] = {}
    try:
        batch: list[Any] = []
        out["landed_batch"] = opens.count(lambda: batch.extend(ov.landed_batch(settings, cfg, "run1", 1) or []))
        assert sorted(r["rollout_id"] for r in batch) == [f"r1-{g}-{s}" for g in range(GROUPS) for s in range(SAMPLES)]
        ages: dict[int, int] = {}
        out["call_ages"] = opens.count(lambda: ages.update(ov.call_ages(settings, "run1", 1, 3)))
        assert ages == {0: GROUPS * SAMPLES}
        summary: dict[str, Any] = {}
        out["harness_summary"] = opens.count(lambda: summary.update(harness_details(settings.lake_dir, "run1", 1)))
        assert summary["chat-loop"]["rollouts"] == GROUPS * SAMPLES and summary["chat-loop"]["calls"] == 4
        example: dict[str, Any] = {}
        out["example_tree"] = opens.count(
            lambda: example.update(render_example_tree(settings, "run1", 1, tokenizer_dir=tok, out_dir=home / "t"))
        )
        assert example["tree_id"].startswith("rollout:r1-")
        nodes: list[Any] = []
        out["tree_show"] = opens.count(
            lambda: nodes.extend(read_tree_nodes(settings.lake_dir, example["tree_id"], run_id="run1", iteration=1))
        )
        assert nodes and {n["iteration"] for n in nodes} == {1}
        loaded: list[Any] = []
        out["train_load"] = opens.count(lambda: loaded.extend(load_trees(settings.lake_dir, "run1", 1, TrainConfig())))
        assert loaded[0] and set(loaded[1]) == {f"r1-{g}-{s}" for g in range(GROUPS) for s in range(SAMPLES)}
        built: list[Any] = []  # last: it swaps the iteration's tree folders for new (unwatched) ones
        out["tree_build"] = opens.count(lambda: built.append(build_iteration(settings.lake_dir, "run1", 1)))
        assert built[0].n_calls == GROUPS * SAMPLES
    finally:
        opens.close()
    return out


def test_per_iteration_queries_open_their_iterations_files_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    small = _opened_by_iteration_queries(tmp_path / "small", 2, monkeypatch)
    large = _opened_by_iteration_queries(tmp_path / "large", 20, monkeypatch)
    for name in ("landed_batch", "call_ages", "harness_summary", "tree_build", "tree_show", "train_load"):
        assert small[name] == large[name], (name, small[name], large[name])
        assert sum(large[name].values()) > 0, name  # the iteration's own files are read
    assert small["example_tree"] == large["example_tree"]  # its choice (tree_stats) and its nodes (tree_nodes)
    assert large["example_tree"]["tree_stats"] > 0 and large["example_tree"]["tree_nodes"] > 0
