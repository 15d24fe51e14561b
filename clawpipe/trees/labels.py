"""Branch labels of a prefix tree: why each node that starts a branch exists.

A rollout tree's branches are labelled by :func:`classify` from the order of the rollout's calls: a
``retry`` re-sends a prompt an earlier call sent, a ``choice`` is another of the n choices of one call,
``rewrite`` / ``drift`` / ``subagent`` are prompts leaving earlier context. A group tree's branches take the
label their rollout's own tree gives them (:func:`group_labels`): rollouts do not share a timeline.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from clawpipe.trees.shapes import TreeNodes, TreeSequences

# Branch causes, in the order of tree_stats' branches_* columns. 0 = no branch.
CAUSES = ("retry", "choice", "rewrite", "subagent", "drift", "rollout")
RETRY, CHOICE, REWRITE, SUBAGENT, DRIFT, ROLLOUT = range(1, 7)


@dataclass
class LabelContext:
    """What branch classification reads: per-sequence facts and per-node aggregates (preorder ids)."""

    seqs: TreeSequences
    par: list[int]
    starts: list[int]
    gens: list[int]
    earliest: list[int]
    size: list[int]  # subtree size: the subtree of v is node ids [v, v + size[v])
    end_node: list[int]
    ends_at: list[int]  # sequences ending at each node
    group_scope: bool


def _latest_through(ctx: LabelContext) -> list[int]:
    """The latest sequence (rank) ending in each node's subtree, -1 where none; bottom-up over preorder ids."""
    latest = [-1] * len(ctx.par)
    for j, v in enumerate(ctx.end_node):
        latest[v] = j  # ranks ascend, so the last one written is the latest
    for v in range(len(ctx.par) - 1, -1, -1):
        p = ctx.par[v]
        if p >= 0 and latest[v] > latest[p]:
            latest[p] = latest[v]
    return latest


def _resumes_with_tail(old: np.ndarray, new: np.ndarray) -> bool:
    """Whether ``new`` starts with a tail of ``old`` (a non-empty suffix of ``old[1:]``).

    A few candidate starts (where ``old`` holds ``new[0]``) are compared directly. A repetitive completion
    (one id thousands of times) has a candidate at almost every position, and comparing each would cost the
    square of its length; there one prefix-function pass over ``new[:m] + sentinel + old[1:]`` (m = the
    longest tail) finds the longest suffix of ``old[1:]`` that ``new`` starts with, in linear time.
    """
    starts = np.flatnonzero(old[1:] == new[0])
    if len(starts) <= 32:
        for k in starts.tolist():
            tail = old[k + 1 :]
            if len(tail) <= len(new) and np.array_equal(tail, new[: len(tail)]):
                return True
        return False
    s = [*new[: len(old) - 1].tolist(), -1, *old[1:].tolist()]  # ids are >= 0: -1 matches nothing
    border = [0] * len(s)
    for i in range(1, len(s)):
        b = border[i - 1]
        while b and s[i] != s[b]:
            b = border[b - 1]
        border[i] = b + 1 if s[i] == s[b] else b
    return border[-1] > 0


def _re_encodes(seqs: TreeSequences, g: int, e: int, d: int) -> bool:
    """Whether sequence e's prompt, diverging inside g's completion at depth d, re-encodes that completion.

    Without a tokenizer this is a heuristic on ids: not when the prompt skips ahead and resumes with a
    tail of the completion (dropped reasoning: ``<think>..</think>answer`` replayed as ``answer``); yes
    when the divergence is after the completion's first token (its start was replayed verbatim) or at its
    last token (a stop token replayed as another one); at the first token, yes when most of the
    completion's ids reappear right after the divergence.
    """
    old = np.frombuffer(seqs.keys[g], dtype=np.uint32)[d:]  # g's completion from the divergence on
    new = np.frombuffer(seqs.keys[e], dtype=np.uint32)[d:]
    if not len(old) or not len(new):
        return d > seqs.plen[g]
    if _resumes_with_tail(old, new):
        return False
    if d > seqs.plen[g] or len(old) == 1:
        return True  # its start was replayed verbatim, or only its last token (e.g. a stop token) differs
    window = new[: len(old) + 8]
    return bool(np.isin(old, window).mean() >= 0.5)


# prompt ids before the previous answer that must come back with it: the answer alone (an end-of-turn id, a
# short reply) turns up in unrelated prompts by chance
_LEAD_IN = 16
_MAX_EDIT_SHIFT = 32  # ids an edit of the history in front may add or remove and still be the same lineage


def _carries_on_edited(ctx: LabelContext, p: int, e: int, d: int) -> bool:
    """Whether sequence e, leaving its parent node p at depth d, carries on the lineage of the call ranked just
    before it with the history in front edited: the previous sequence passes through p, and e replays after d
    that call's whole answer together with the end of the prompt that led to it. A system prompt stamped with
    the time of each turn diverges near the start this way; a sub-agent's own prompt does not."""
    if e == 0:
        return False
    seqs, j = ctx.seqs, e - 1
    plen, glen = seqs.plen[j], seqs.glen[j]
    if not glen or (p >= 0 and not p <= ctx.end_node[j] < p + ctx.size[p]):
        return False
    lead = max(d + 1, plen - _LEAD_IN)  # the id at d is where the two part: it is not replayed
    replayed = seqs.keys[j][lead * 4 : (plen + glen) * 4]
    new = seqs.keys[e]
    # where an edit of the history in front (a timestamp) moves the replay by a few ids; a prompt that quotes
    # the conversation after instructions of its own (a memory extractor's) moves it by their whole length
    lo, hi = max(d, lead - _MAX_EDIT_SHIFT) * 4, (lead + _MAX_EDIT_SHIFT) * 4 + len(replayed)
    at = new.find(replayed, lo, hi)
    while at >= 0 and at % 4:  # ids are 4 bytes: a match must start on an id
        at = new.find(replayed, at + 1, hi)
    return at >= 0


def classify(ctx: LabelContext) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Label each node that starts a branch (every child but the earliest of a parent) with its cause.

    Siblings are ordered by their earliest sequence. In a group tree every branch is only marked here
    (``rollout``, with its earliest sequence) and labelled by :func:`group_labels`. In a rollout tree the
    reference siblings of child X (earliest sequence e) are the earlier ones:
    - X's first token generated by e: ``choice`` when a reference was generated by the same call, else ``retry``;
    - X is context and a reference was generated by call g before e: ``drift`` when the later prompt re-encodes g's
      output (see :func:`_re_encodes`), else ``rewrite`` (g's output dropped or replaced: stripped
      reasoning, compaction right after a prompt);
    - both context: ``subagent`` when the old lineage goes on after X's first call (interleaved lineages)
      or both continue a call that ended at the parent (a fork), or the divergence lies near the start (in
      the first half of the first prompt through the parent: another system prompt) unless X's prompt
      replays the previous call's answer, and the end of its prompt, after it within a few ids of where it
      was (the same lineage with its system prompt edited, e.g. a timestamp); else ``rewrite`` (compaction,
      edited history: the divergence is inside earlier context and the old lineage stops).
    """
    seqs, par, starts, gens, earliest = ctx.seqs, ctx.par, ctx.starts, ctx.gens, ctx.earliest
    n = len(par)
    cause = np.zeros(n, dtype=np.int8)
    cause_seq = np.full(n, -1, dtype=np.int64)
    drift_seq = np.full(n, -1, dtype=np.int64)
    kids: dict[int, list[int]] = {}
    for v in range(n):
        kids.setdefault(par[v], []).append(v)
    latest = _latest_through(ctx)
    for p, ch in kids.items():
        if len(ch) < 2:
            continue
        ch.sort(key=earliest.__getitem__)
        parent_first = min(earliest[c] for c in ch) if p < 0 else earliest[p]
        # What the earlier siblings (the references) hold, kept up to date as each sibling joins them, so
        # a parent with k children costs O(k log k) rather than O(k^2) (thousands of history rewrites).
        ref_gens: list[int] = []  # sorted generators of the references
        ref_calls: set[int] = set()  # calls that generated a reference
        ref_latest = -1  # the latest sequence through any reference
        for i in range(1, len(ch)):
            y = ch[i - 1]
            if gens[y] >= 0:
                bisect.insort(ref_gens, gens[y])
                ref_calls.add(seqs.call[gens[y]])
            ref_latest = max(ref_latest, latest[y])
            x = ch[i]
            e = earliest[x]
            cause_seq[x] = e
            if ctx.group_scope:
                cause[x] = ROLLOUT
                continue
            d = starts[x]
            if gens[x] == e:  # e's own first token here is generated (a later call may generate it otherwise)
                cause[x] = CHOICE if seqs.call[e] in ref_calls else RETRY
                continue
            # only a completion made before e's call can be re-encoded or dropped by e's prompt; tokens a
            # later call generates were context when e was sent
            k = bisect.bisect_left(ref_gens, e)
            if k:
                g = ref_gens[k - 1]  # the latest generating call among the references
                if _re_encodes(seqs, g, e, d):
                    cause[x] = DRIFT
                    drift_seq[x] = g
                else:
                    cause[x] = REWRITE
                continue
            near_start = 2 * d < seqs.plen[parent_first]
            fork = p >= 0 and ctx.ends_at[p] > 0  # both continue a finished call: its lineage forked
            # interleaving: a sequence ranked after e still passes through a reference
            interleaved = fork or ref_latest > e
            other_start = near_start and not _carries_on_edited(ctx, p, e, d)
            cause[x] = SUBAGENT if interleaved or other_start else REWRITE
    return cause, cause_seq, drift_seq


def group_labels(
    seqs: TreeSequences,
    starts: list[int],
    cause: np.ndarray,
    cause_seq: np.ndarray,
    drift_seq: np.ndarray,
    rollout_trees: dict[int, tuple[TreeNodes, list[int]]],
) -> None:
    """Label a group tree's branches within one rollout, in place.

    Rollouts do not share a timeline: which rollout reached a node first says nothing about a retry or a
    choice. A branch X (starting at depth d, earliest sequence e of rollout r) therefore takes the label
    of the node that starts at depth d on e's path in r's own tree (``rollout_trees[r]``: that tree and the
    group-tree indices of its sequences): a retry there is a later call of r going where an earlier call
    of r went, a choice another choice of the same call of r, and so on. When r's tree has no branch
    there (r's sequences all take X's way at d, or X is r's main line), X is where r leaves the other
    rollouts: ``rollout``.
    """
    local = [0] * len(seqs.rollout)
    for _, js in rollout_trees.values():
        for k, j in enumerate(js):
            local[j] = k
    for x in np.flatnonzero(cause).tolist():
        e = int(cause_seq[x])
        t, js = rollout_trees[seqs.rollout[e]]
        d = starts[x]
        v = int(t.end_node[local[e]])
        while int(t.start[v]) > d:
            v = int(t.parent[v])
        if int(t.start[v]) == d and t.cause[v]:
            cause[x] = t.cause[v]
            g = int(t.drift_seq[v])
            drift_seq[x] = js[g] if g >= 0 else -1
        else:
            cause[x] = ROLLOUT
            drift_seq[x] = -1
