"""The README and docs/*.md as a new user follows them: the README's ad hoc SQL runs against a lake landed from
real capture segments and returns what its comment says, every ``clawpipe <subcommand> --flag`` the docs
name exists in the CLI, every ``clawpipe.<module>.<name>`` they cite imports, and the CLI's own help shows
its text as written. A doc that drifts from the code fails here."""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from clawpipe.cli import app
from clawpipe.sqlfiles import sql_names
from tests.lake import fixtures as fx

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]

# Flags of other programs the README names in passing: bubblewrap's (how the sandbox starts it) and Docker's.
FOREIGN_FLAGS = {"--args", "--unshare-ipc", "--network"}


# ---- what the docs say --------------------------------------------------------------------------------------


def sql_examples(text: str) -> dict[str, str]:
    """The statements of the ```sql blocks, keyed by the ``-- comment`` each starts with."""
    out: dict[str, str] = {}
    for block in re.findall(r"```sql\n(.*?)```", text, re.S):
        for stmt in re.split(r";\s*(?:\n|$)", block):
            if not stmt.strip():
                continue
            title = re.match(r"\s*--\s*(.+)", stmt)
            assert title, f"a README SQL example without a '-- what it does' first line: {stmt[:80]!r}"
            out[title.group(1).strip()] = stmt.strip()
    return out


def code_spans(text: str) -> list[str]:
    """Command lines as a reader copies them: each line of a shell (or unlabelled) block, its ``# comment``
    cut off and continuation lines joined, plus every inline `code` span of the prose."""
    spans: list[str] = []
    for lang, body in re.findall(r"```(\w*)\n(.*?)```", text, re.S):
        if lang in ("", "bash", "sh"):
            spans += [re.sub(r"\s#\s.*$", "", line) for line in body.replace("\\\n", " ").splitlines()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    return spans + re.findall(r"`([^`\n]+)`", prose)


def _options(cmd: Any) -> set[str]:
    return {o for p in cmd.params for o in (*p.opts, *p.secondary_opts)} | {"--help"}


def _default(cmd: Any, flag: str) -> Any:
    return next((p.default for p in cmd.params if flag in p.opts), None)


def _all_options(cmd: Any) -> set[str]:
    found = _options(cmd)
    for sub in getattr(cmd, "commands", {}).values():
        found |= _all_options(sub)
    return found


def cli_mismatches(text: str, root: Any) -> list[str]:
    """Every ``clawpipe <subcommand>`` in ``text`` whose subcommand or ``--flag`` the CLI does not have, and
    every `--flag` span standing alone that no clawpipe command (nor FOREIGN_FLAGS) has."""
    problems: list[str] = []
    every_flag = _all_options(root)
    for span in code_spans(text):
        for m in re.finditer(r"(?:^|(?<=[\s(\"'=/]))clawpipe((?:\s+[^\s|;&`]+)+)", span):
            words = m.group(1).split()
            if not re.fullmatch(r"[a-z][a-z-]*", words[0]):
                continue  # prose such as "clawpipe's", or an argument
            cmd, path = root, []
            while hasattr(cmd, "commands") and words and words[0] in cmd.commands:
                cmd = cmd.commands[words[0]]
                path.append(words.pop(0))
            if not path:
                problems.append(f"clawpipe {m.group(1).split()[0]}: no such subcommand ({span[:80]!r})")
                continue
            if hasattr(cmd, "commands") and words and re.fullmatch(r"[a-z][a-z-]*", words[0]):
                problems.append(f"clawpipe {' '.join(path)} {words[0]}: no such subcommand ({span[:80]!r})")
            own = words[: words.index("clawpipe") if "clawpipe" in words else len(words)]
            for word, after in zip(own, [*own[1:], ""][: len(own)], strict=True):
                flag = re.match(r"\[?(--[a-z][\w-]*)", word)
                if flag and flag.group(1) not in _options(cmd):
                    problems.append(f"clawpipe {' '.join(path)} has no {flag.group(1)} ({span[:80]!r})")
                elif flag and word.startswith("[") and re.fullmatch(r"[\d.]+\]", after):
                    # `[--flag N]` in a usage line shows the flag's default
                    default = _default(cmd, flag.group(1))
                    if default is None or float(after[:-1]) != float(default):
                        problems.append(f"clawpipe {' '.join(path)} {flag.group(1)} defaults to {default}, not {after}")
        if span.startswith("--") and "clawpipe" not in span:
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", span):
                if flag not in every_flag | FOREIGN_FLAGS:
                    problems.append(f"no clawpipe command has {flag} ({span[:80]!r})")
    return problems


# ---- the lake the SQL examples run against ------------------------------------------------------------------


@pytest.fixture
def lake(home: Path) -> Iterator[Path]:
    """Real capture segments and result rows, landed by ``clawpipe land``: a chat-loop rollout whose first
    completion was cut by max_tokens, a tool-agent rollout that called the calculator, and an eval rollout
    the examples must leave out."""
    cap = home / "captures"
    cut = fx.Completion(finish="length", ids=[7, 8, 9, 10], logprobs=[-0.5] * 4, pieces=["a", "b", "c", "d"])
    tool = fx.Completion(tool=("calculator", {"expression": "2+3"}), finish="tool_calls")
    fx.write_segment(
        cap / "p-000001.seg",
        [
            fx.record("chat", False, cut, rollout_id="r-chat", seq=0, call_id="c0"),
            fx.record("chat", True, None, rollout_id="r-chat", seq=1, call_id="c1"),
            fx.record("chat", False, tool, rollout_id="r-tool", seq=0, call_id="c2"),
            fx.record("chat", False, None, rollout_id="r-eval", seq=0, call_id="c3"),
        ],
    )
    fx.write_results(
        cap,
        [
            fx.rollout_row("r-chat", harness="chat-loop", reward=0.75, n_calls=2),
            fx.rollout_row("r-tool", harness="tool-agent", task_set="calc", reward=0.25, group_id="g1"),
            fx.rollout_row("r-eval", harness="tool-agent", task_set="calc", reward=1.0, eval=True, group_id="g2"),
        ],
    )
    res = CliRunner().invoke(app, ["land"])
    assert res.exit_code == 0 and "landed 4 calls (4 rows), 3 rollout rows, 0 rejects" in res.output, res.output
    yield home / "lake"


def _per_harness(rows: list[dict[str, Any]]) -> None:
    assert [(r["harness"], r["rollouts"], r["mean_reward"], r["calls_per_rollout"]) for r in rows] == [
        ("chat-loop", 1, 0.75, 2.0),
        ("tool-agent", 1, 0.25, 1.0),  # the eval rollout (reward 1.0) is left out
    ]


def _truncated(rows: list[dict[str, Any]]) -> None:
    assert len(rows) == 1
    row = rows[0]
    assert (row["run_id"], row["iteration"], row["api"], row["truncated"], row["avg_tokens"]) == (
        "run1",
        0,
        "chat",
        1,
        4.0,
    )
    assert row["p50_ms"] == pytest.approx(50.0)


def _tool_calls(rows: list[dict[str, Any]]) -> None:
    assert [(r["rollout_id"], r["seq"], r["tool"]) for r in rows] == [("r-tool", 0, "calculator")]
    assert json.loads(rows[0]["arguments"]) == {"expression": "2+3"}


# What each README example must return on the lake above, keyed by its comment line: a new example needs its
# expectation here, and a changed comment or query shows up as a failure.
EXPECTED: dict[str, Callable[[list[dict[str, Any]]], None]] = {
    "reward and calls per rollout, by harness": _per_harness,
    "completions cut by max tokens": _truncated,
    "the tool calls harnesses made, with their arguments": _tool_calls,
}


def test_every_readme_sql_example_has_an_expectation() -> None:
    assert set(sql_examples(README.read_text())) == set(EXPECTED)


@pytest.mark.parametrize("title", sorted(EXPECTED))
def test_readme_sql_example_returns_what_its_comment_says(lake: Path, title: str) -> None:
    query = sql_examples(README.read_text())[title]
    # as the README says to run a saved example: `clawpipe sql - < q.sql`, its comment line included
    res = CliRunner().invoke(app, ["sql", "-", "--format", "json"], input=query)
    assert res.exit_code == 0, res.output
    EXPECTED[title]([json.loads(line) for line in res.stdout.splitlines()])


def test_sql_reads_a_query_from_stdin_and_refuses_an_empty_one(lake: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(
        app, ["sql", "-", "--format", "csv"], input="-- count them\nselect count(*) as n from rollouts;\n"
    )
    assert res.exit_code == 0 and res.stdout.splitlines() == ['"n"', "3"], res.output
    empty = runner.invoke(app, ["sql", "-"], input="  \n")
    assert empty.exit_code != 0 and "read no statement from stdin" in empty.output


def test_sql_stops_quietly_when_its_reader_stops_reading(lake: Path) -> None:
    """``clawpipe sql ... | head``: the rows past what the reader took are not an error about ``--out``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "clawpipe", "sql", "select range as n from range(300000)"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().split() == [b"n"]
    proc.stdout.close()  # as head does after its lines
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1
    assert "error" not in err and "Traceback" not in err and "Broken pipe" not in err, err


# ---- commands, flags and names the docs cite ----------------------------------------------------------------


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_clawpipe_command_and_flag_the_docs_name_exists(doc: Path) -> None:
    assert cli_mismatches(doc.read_text(), typer.main.get_command(app)) == []


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("`clawpipe sql --saved x --nope 1`", "clawpipe sql has no --nope"),
        ("```bash\nclawpipe lake vacuum   # tidy\n```", "clawpipe lake vacuum: no such subcommand"),
        ("```bash\nclawpipe proxy --upstream U \\\n    [--max-body-mb 32] [--bogus 1]\n```", "has no --bogus"),
        ("`clawpipe frobnicate`", "clawpipe frobnicate: no such subcommand"),
        ("`clawpipe proxy --upstream U [--max-body-mb 16]`", "--max-body-mb defaults to 32.0, not 16]"),
        ("`--kv-budget-token`", "no clawpipe command has --kv-budget-token"),
    ],
)
def test_a_doc_naming_a_missing_command_or_flag_is_caught(text: str, problem: str) -> None:
    found = cli_mismatches(text, typer.main.get_command(app))
    assert len(found) == 1 and problem in found[0], found


def test_the_saved_queries_the_readme_runs_exist() -> None:
    named = set(re.findall(r"--saved ([a-z_]+)", README.read_text()))
    assert named and named <= set(sql_names("analytics"))


def test_sql_help_names_every_view_of_the_lake() -> None:
    res = CliRunner().invoke(app, ["sql", "--help"], env={"COLUMNS": "2000"})
    shown = " ".join(res.output.split())
    assert [v for v in sql_names("views") if v not in shown] == []


def _commands(cmd: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    for name, sub in sorted(getattr(cmd, "commands", {}).items()):
        yield (*path, name), sub
        yield from _commands(sub, (*path, name))


def test_every_flags_help_shows_as_written() -> None:
    """Help text goes through rich markup: a bracketed word such as the manifest's ``[env]`` would vanish."""
    root = typer.main.get_command(app)
    runner = CliRunner()
    missing = []
    for path, cmd in _commands(root):
        shown = " ".join(runner.invoke(app, [*path, "--help"], env={"COLUMNS": "2000"}).output.split())
        for p in cmd.params:
            # what the author meant to show: rich's escape \[ stands for a literal [
            text = " ".join((getattr(p, "help", None) or "").replace("\\[", "[").split())
            if "[" in text and text not in shown:
                missing.append(f"clawpipe {' '.join(path)} {p.opts[0] if p.opts else p.name}: {text!r}")
    assert missing == []


def _dotted_names(text: str) -> set[str]:
    """``clawpipe.<module>...`` names; other dotted ``clawpipe.*`` words (MLflow tags such as
    ``clawpipe.git_dirty``) are not Python."""
    names = set(re.findall(r"(?<![\w/.-])(clawpipe(?:\.[A-Za-z_]\w*)+)", text))
    return {n for n in names if importlib.util.find_spec(".".join(n.split(".")[:2])) is not None}


def _resolve(name: str) -> object:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


@pytest.mark.slow
def test_every_python_name_the_docs_cite_imports() -> None:
    """``clawpipe.sandbox.runner.run_rollouts``, ``clawpipe.serving.server.start_server``, ...: each resolves
    (the serving and training ones import torch, hence slow)."""
    names = set().union(*(_dotted_names(d.read_text()) for d in DOCS))
    assert len(names) > 20
    broken = []
    for name in sorted(names):
        try:
            _resolve(name)
        except (ImportError, AttributeError) as exc:
            broken.append(f"{name}: {exc}")
    assert broken == []


def test_every_repository_path_the_docs_cite_exists() -> None:
    pattern = r"(?<![\w./$<-])((?:clawpipe|sql|tests|flows|harnesses|bench|docs|scripts|mlflow)/[\w./*-]*[\w/*])"
    missing = []
    for doc in DOCS:
        for cited in sorted(set(re.findall(pattern, doc.read_text()))):
            found = list(ROOT.glob(cited)) or list(ROOT.glob(cited + ".py")) or list(ROOT.glob(cited + ".sql"))
            if not found:
                missing.append(f"{doc.name}: {cited}")
    assert missing == []
