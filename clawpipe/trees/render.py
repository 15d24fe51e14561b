"""Readable renderings of one prefix tree: indented text for a terminal, one self-contained HTML file.

Segments are decoded with the policy's tokenizer when a tokenizer directory is given
(``tokenizers.Tokenizer.from_file(dir/tokenizer.json)``; torch and transformers stay out of trees),
else shown as abbreviated token ids. A chain of single children continues at the same indentation;
only real branches indent, so a 20-turn linear rollout stays readable.
"""

from __future__ import annotations

import html
import os
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa

from clawpipe import tables
from clawpipe.errors import TreeError
from clawpipe.sqlfiles import sql_text

Decoder = Callable[[list[int]], str]


def load_decoder(tokenizer_dir: str | os.PathLike[str] | None) -> Decoder | None:
    """A token-ids -> text function from ``<dir>/tokenizer.json``, or None without a directory."""
    if tokenizer_dir is None:
        return None
    path = Path(tokenizer_dir) / "tokenizer.json"
    if not path.is_file():
        raise TreeError(
            f"no tokenizer.json in {tokenizer_dir}; pass the policy directory (made by `clawpipe model init`)"
        )
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path))
    return lambda ids: tok.decode(ids, skip_special_tokens=False)


def read_tree_nodes(
    lake_root: str | os.PathLike[str], tree_id: str, *, run_id: str | None = None, iteration: int | None = None
) -> list[dict]:
    """Nodes of one tree from the lake, parent-first. Raises when missing or ambiguous across runs."""
    pinned = (run_id, int(iteration)) if run_id and iteration is not None else None  # that partition's files only
    con = tables.connect(lake_root, tables=("tree_nodes",), partition=pinned)
    params = {"tree_id": tree_id, "run_id": run_id or "", "iteration": -1 if iteration is None else int(iteration)}
    rows = con.sql(sql_text("trees/show"), params=params).to_arrow_table().to_pylist()
    if not rows:
        raise TreeError(
            f"no tree {tree_id!r} in {lake_root}; ids look like rollout:<rollout_id> or group:<group_id> "
            "(group-of:<rollout_id> for a rollout without a group)"
        )
    parts = {(r["run_id"], r["iteration"]) for r in rows}
    if len(parts) > 1:
        raise TreeError(
            f"tree {tree_id!r} exists in several run/iterations {sorted(parts)}; pass --run and --iteration"
        )
    return rows


def _abbrev_ids(ids: list[int], keep: int = 8) -> str:
    if len(ids) <= 2 * keep:
        return " ".join(map(str, ids))
    return f"{' '.join(map(str, ids[:keep]))} … ({len(ids) - 2 * keep} more) … {' '.join(map(str, ids[-keep:]))}"


def _abbrev_text(text: str, width: int) -> str:
    text = text.replace("\n", "⏎")
    if len(text) <= width:
        return text
    half = max(1, (width - 5) // 2)
    return f"{text[:half]} … {text[-half:]}"


def segment_text(node: dict, decode: Decoder | None, width: int = 80) -> str:
    """The node's tokens, decoded and abbreviated to about ``width`` characters (ids without a decoder)."""
    ids = list(node["token_ids"] or [])
    if decode is None:
        return f"[{_abbrev_ids(ids)}]"
    return repr(_abbrev_text(decode(ids), width))


def _short(call_id: str | None, full: bool) -> str:
    """Call ids abbreviated git-style (first 8 characters) unless ``full``."""
    if call_id is None or full or len(call_id) <= 12:
        return str(call_id)
    return call_id[:8]


def _label(node: dict, full_ids: bool = False) -> str:
    n = len(node["token_ids"] or [])
    kind = f"GEN {_short(node['call_id'], full_ids)}" if node["generated"] else "ctx"
    if node["generated"] and node.get("policy_version") is not None:
        kind += f" v{node['policy_version']}"
    bits = [f"#{node['node_id']}", kind, f"{n} tok", f"@{node['depth']}", f"seqs={node['n_seqs']}"]
    if node.get("branch_cause"):
        cause = node["branch_cause"]
        if cause == "drift":
            cause += f"({_short(node['call_id'], full_ids)} re-encodes {_short(node['drift_call_id'], full_ids)})"
        bits.append(f"<{cause}>")
    if node["is_leaf"]:
        reward = node.get("reward")
        bits.append(f"leaf reward={'?' if reward is None else f'{reward:g}'} {','.join(node['rollout_ids'] or [])}")
    return " ".join(bits)


def _children(nodes: list[dict]) -> dict[int, list[dict]]:
    kids: dict[int, list[dict]] = {}
    for n in sorted(nodes, key=lambda n: n["node_id"]):
        kids.setdefault(n["parent_id"], []).append(n)
    return kids


def render_text(nodes: list[dict] | pa.Table, *, decode: Decoder | None = None, width: int = 80) -> str:
    """An indented text rendering: one line per node; only branches indent."""
    rows = nodes.to_pylist() if isinstance(nodes, pa.Table) else nodes
    if not rows:
        return "(empty tree)\n"
    kids = _children(rows)
    head = rows[0]
    lines = [f"tree {head['tree_id']} ({head['scope']}) run={head['run_id']} iteration={head['iteration']}"]
    stack: list[tuple[dict, str, str]] = [(c, "", "") for c in reversed(kids.get(-1, []))]
    if len(kids.get(-1, [])) > 1:
        stack = [(c, "├─ " if i else "└─ ", "│  " if i else "   ") for i, c in enumerate(reversed(kids[-1]))]
    while stack:
        node, lead, cont = stack.pop()
        lines.append(f"{lead}{_label(node)}  {segment_text(node, decode, width)}")
        ch = kids.get(node["node_id"], [])
        if len(ch) == 1:
            stack.append((ch[0], cont, cont))
        else:
            for i, c in enumerate(reversed(ch)):
                last = i == 0
                stack.append((c, cont + ("└─ " if last else "├─ "), cont + ("   " if last else "│  ")))
    return "\n".join(lines) + "\n"


_CSS = """
body { font: 13px/1.45 ui-monospace, SFMono-Regular, Menlo, monospace; margin: 1.5em; color: #222; }
h1 { font-size: 16px; } .legend span { margin-right: 1.2em; }
.node { margin: 2px 0; padding: 2px 6px; border-left: 3px solid #bbb; white-space: pre-wrap; word-break: break-all; }
.gen { border-left-color: #2a7; background: #eefaf3; } .ctx { background: #f6f6f6; }
.meta { color: #667; font-size: 11px; } .cause { color: #b50; font-weight: bold; }
.drift { color: #c00; } .leaf { color: #05a; font-weight: bold; }
.branch { margin-left: 1.4em; border-left: 1px dashed #ccc; padding-left: .6em; }
summary { cursor: pointer; color: #445; }
"""


def render_html(nodes: list[dict] | pa.Table, *, decode: Decoder | None = None, width: int = 400) -> str:
    """One self-contained HTML page (inline CSS, no scripts): branches are collapsible ``<details>``."""
    rows = nodes.to_pylist() if isinstance(nodes, pa.Table) else nodes
    kids = _children(rows)
    title = f"tree {rows[0]['tree_id']}" if rows else "empty tree"

    def block(node: dict) -> str:
        cls = "gen" if node["generated"] else "ctx"
        cause = node.get("branch_cause")
        meta = html.escape(_label(node, full_ids=True))
        if cause:
            meta = meta.replace(html.escape(f"<{cause}"), f'<span class="cause {cause}">&lt;{cause}', 1)
            meta = meta.replace("&gt;", "&gt;</span>", 1)
        text = html.escape(segment_text(node, decode, width))
        return f'<div class="node {cls}"><div class="meta">{meta}</div>{text}</div>'

    def subtree(root: dict) -> str:
        # iterative: deep trees must not hit the recursion limit
        out: list[str] = []
        stack: list[tuple[str, dict | None]] = [("node", root)]
        while stack:
            kind, node = stack.pop()
            if kind == "close" or node is None:
                out.append("</details>")
                continue
            if kind == "open":
                label = (
                    f"branch #{node['node_id']} {node.get('branch_cause') or 'main line'}, {node['n_leaves']} leaves"
                )
                out.append(f'<details open class="branch"><summary>{html.escape(label)}</summary>')
                continue
            out.append(block(node))
            ch = kids.get(node["node_id"], [])
            while len(ch) == 1:
                out.append(block(ch[0]))
                ch = kids.get(ch[0]["node_id"], [])
            for c in reversed(ch):
                stack += [("close", None), ("node", c), ("open", c)]
        return "".join(out)

    body = "".join(subtree(r) for r in kids.get(-1, []))
    head = rows[0] if rows else {"scope": "", "run_id": "", "iteration": ""}
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{_CSS}</style></head><body><h1>{html.escape(title)}</h1>"
        f"<p class='meta'>scope {html.escape(str(head['scope']))} · run {html.escape(str(head['run_id']))} · "
        f"iteration {html.escape(str(head['iteration']))} · {len(rows)} nodes</p>"
        "<p class='legend meta'><span class='node gen'>generated (call, policy version, logprobs kept)</span>"
        "<span class='node ctx'>context</span><span class='cause'>&lt;branch cause&gt;</span></p>"
        f"{body}</body></html>\n"
    )
