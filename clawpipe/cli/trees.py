"""``clawpipe trees``: rebuild prefix trees from the lake, and show one (imports the builder only when run)."""

from __future__ import annotations

from pathlib import Path

import typer

trees_app = typer.Typer(help="Token prefix trees rebuilt from captured calls (per rollout and per group).")


def register(app: typer.Typer) -> None:
    app.add_typer(trees_app, name="trees")


@trees_app.command("build")
def build(
    run: str = typer.Option(..., "--run", help="Run id whose calls to rebuild into trees."),
    iteration: int | None = typer.Option(None, "--iteration", help="One iteration; default every iteration."),
    lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <home>/lake."),
) -> None:
    """Build rollout and group trees and replace the run's tree_nodes, tree_stats and tree_sequences partitions."""
    from clawpipe.config import get_settings
    from clawpipe.trees import build_trees

    for s in build_trees(lake or get_settings().lake_dir, run, iteration):
        b = s.branches
        typer.echo(
            f"{s.run_id}/{s.iteration}: {s.n_trees} trees, {s.n_nodes} nodes, {s.n_calls} calls; "
            f"tokens {s.flattened_tokens} flattened / {s.unique_tokens} unique; "
            f"branches retry={b['retry']} choice={b['choice']} rewrite={b['rewrite']} subagent={b['subagent']} "
            f"drift={b['drift']} rollout={b['rollout']}; failed={s.failed_calls} truncated={s.truncated_calls} "
            f"kept out: retokenized={s.kept_out_retokenized} no_ids={s.kept_out_no_ids}; {s.seconds:.2f} s"
        )


@trees_app.command("list")
def list_trees(
    run: str = typer.Option(..., "--run", help="Run id whose trees to list."),
    iteration: int | None = typer.Option(None, "--iteration", help="One iteration; default all."),
    scope: str = typer.Option("", "--scope", help="rollout or group; default both."),
    lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <home>/lake."),
) -> None:
    """List built trees with their sizes and branch counts (ids for `clawpipe trees show`)."""
    from clawpipe import tables
    from clawpipe.config import get_settings
    from clawpipe.sqlfiles import sql_text

    con = tables.connect(lake or get_settings().lake_dir, tables=("tree_stats",))
    params = {"run_id": run, "iteration": -1 if iteration is None else iteration, "scope": scope}
    rel = con.sql(sql_text("trees/list"), params=params)
    rows = rel.fetchall()
    if not rows:
        runs = [r[0] for r in con.sql(sql_text("trees/runs")).fetchall()]
        if run not in runs:  # a mistyped id would otherwise list nothing and succeed
            from clawpipe.errors import ConfigError

            shown = ", ".join(runs[-10:]) if runs else "none (land and build trees first: clawpipe run)"
            raise ConfigError(f"--run {run}: no trees of that run in this lake; runs with trees: {shown}")
    typer.echo("\t".join(rel.columns))
    for row in rows:
        typer.echo("\t".join("" if v is None else str(v) for v in row))


@trees_app.command("show")
def show(
    tree_id: str = typer.Argument(
        ..., help="Tree id: rollout:<rollout_id>, group:<group_id>, or group-of:<rollout_id> (a groupless rollout)."
    ),
    fmt: str = typer.Option("text", "--format", help="text or html."),
    out: Path | None = typer.Option(None, "--out", help="Write to this file instead of stdout."),
    lake: str | None = typer.Option(None, "--lake", help="Lake root (path or URL); default <home>/lake."),
    run: str | None = typer.Option(None, "--run", help="Run id, when the tree id exists in several runs."),
    iteration: int | None = typer.Option(None, "--iteration", help="Iteration, when needed to disambiguate."),
    tokenizer: Path | None = typer.Option(
        None, "--tokenizer", help="Directory with tokenizer.json (the policy dir) to decode segments."
    ),
    width: int = typer.Option(80, "--width", help="Characters of decoded text shown per segment."),
) -> None:
    """Render one tree: segments, generated vs context, branch causes, leaf rewards."""
    from clawpipe.config import get_settings
    from clawpipe.errors import ConfigError
    from clawpipe.trees.render import load_decoder, read_tree_nodes, render_html, render_text

    if fmt not in ("text", "html"):
        raise ConfigError(f"--format {fmt!r}: choose text or html")
    nodes = read_tree_nodes(lake or get_settings().lake_dir, tree_id, run_id=run, iteration=iteration)
    decode = load_decoder(tokenizer)
    page = render_text(nodes, decode=decode, width=width) if fmt == "text" else render_html(nodes, decode=decode)
    if out is None:
        typer.echo(page, nl=False)
    else:
        out.write_text(page, encoding="utf-8")
        typer.echo(f"wrote {out}")
