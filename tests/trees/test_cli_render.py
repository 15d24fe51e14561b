"""`clawpipe trees build|show` through the real CLI, and the text/HTML renderings (ids and decoded text)."""

from __future__ import annotations

import html.parser
from pathlib import Path

import pytest
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.errors import TreeError
from clawpipe.trees.render import load_decoder, read_tree_nodes, render_html, render_text
from tests.trees.fixtures import call, rollout, write_lake

P = [1, 2, 3, 4, 5]


class _Details(html.parser.HTMLParser):
    """Tracks <details> nesting (branches) while parsing the page."""

    def __init__(self) -> None:
        super().__init__()
        self.depth = self.deepest = 0

    def handle_starttag(self, tag: str, attrs: list) -> None:
        if tag == "details":
            self.depth += 1
            self.deepest = max(self.deepest, self.depth)

    def handle_endtag(self, tag: str) -> None:
        if tag == "details":
            self.depth -= 1


@pytest.fixture
def lake(tmp_path: Path) -> Path:
    calls = [
        call("a1", "ra", 0, P, [6, 7]),
        call("a2", "ra", 1, [*P, 6, 7, 8], [9]),
        call("a3", "ra", 2, [*P, 6, 99, 8], [10]),  # drift
        call("b1", "rb", 0, P, [11]),
    ]
    write_lake(tmp_path / "lake", "R", 0, calls, [rollout("ra", "g", 1.0, 0), rollout("rb", "g", 0.25, 1)])
    return tmp_path / "lake"


def test_build_then_show_text_and_html(lake: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["trees", "build", "--run", "R", "--lake", str(lake)])
    assert res.exit_code == 0, res.output
    assert "R/0: 3 trees" in res.output and "drift=1" in res.output and "rollout=1" in res.output

    res = runner.invoke(app, ["trees", "list", "--run", "R", "--lake", str(lake), "--scope", "group"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    assert lines[0].startswith("iteration\ttree_id") and len(lines) == 2 and "\tgroup:g\t" in lines[1]

    # a run with trees but none in the iteration asked: the header alone; a run id with none: said, naming R
    res = runner.invoke(app, ["trees", "list", "--run", "R", "--lake", str(lake), "--iteration", "5"])
    assert res.exit_code == 0 and res.output.splitlines() == [lines[0]], res.output
    res = runner.invoke(app, ["trees", "list", "--run", "Rx", "--lake", str(lake)])
    assert res.exit_code != 0 and "--run Rx: no trees of that run in this lake; runs with trees: R" in str(
        res.exception
    )

    res = runner.invoke(app, ["trees", "show", "group:g", "--lake", str(lake)])
    assert res.exit_code == 0, res.output
    text = res.output
    assert text.startswith("tree group:g (group) run=R iteration=0")
    assert "<drift(a3 re-encodes a1)>" in text and "<rollout>" in text
    assert "leaf reward=0.25 rb" in text and "GEN a1 v1" in text and "[1 2 3 4 5]" in text

    out = tmp_path / "tree.html"
    res = runner.invoke(
        app, ["trees", "show", "rollout:ra", "--lake", str(lake), "--format", "html", "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    page = out.read_text()
    parser = _Details()
    parser.feed(page)
    assert parser.depth == 0 and parser.deepest == 1  # every <details> branch closed; one branch level here
    assert "<script" not in page and "http" not in page.replace("http-equiv", "")
    assert 'class="cause drift"' in page and "tree rollout:ra" in page


def test_show_errors_say_what_to_do(lake: Path) -> None:
    with pytest.raises(TreeError, match="ids look like"):
        read_tree_nodes(lake, "rollout:nope")
    res = CliRunner().invoke(app, ["trees", "show", "x", "--lake", str(lake), "--format", "pdf"])
    assert res.exit_code != 0


def test_decoded_rendering_uses_tokenizer_json(lake: Path, tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models

    vocab = {f"w{i}": i for i in range(120)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    (tmp_path / "policy").mkdir()
    tok.save(str(tmp_path / "policy" / "tokenizer.json"))
    decode = load_decoder(tmp_path / "policy")
    assert decode is not None
    from clawpipe.trees import build_iteration

    build_iteration(lake, "R", 0)
    nodes = read_tree_nodes(lake, "rollout:ra", run_id="R", iteration=0)
    text = render_text(nodes, decode=decode)
    assert "'w1 w2 w3 w4 w5'" in text and "'w99 w8'" in text
    page = render_html(nodes, decode=decode)
    assert "w99 w8" in page
    with pytest.raises(TreeError, match=r"no tokenizer\.json"):
        load_decoder(tmp_path)


def test_long_segments_are_abbreviated() -> None:
    node = {
        "tree_id": "rollout:x",
        "scope": "rollout",
        "run_id": "R",
        "iteration": 0,
        "node_id": 0,
        "parent_id": -1,
        "depth": 0,
        "token_ids": list(range(100)),
        "generated": False,
        "call_id": None,
        "policy_version": None,
        "n_seqs": 1,
        "branch_cause": None,
        "is_leaf": True,
        "reward": None,
        "rollout_ids": ["x"],
        "n_leaves": 1,
    }
    text = render_text([node])
    assert "0 1 2 3 4 5 6 7 … (84 more) … 92 93 94 95 96 97 98 99" in text and "reward=?" in text
    assert len(render_text([node], decode=lambda ids: "x" * 500, width=40).splitlines()[1]) < 120
