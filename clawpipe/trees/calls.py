"""The input of the tree builder: call rows (``sql/trees/calls.sql``) as one sorted batch of numpy arrays.

:func:`prepare` sorts the rows into rank order (group, sample, rollout, then call order: seq, or the time
for a rollout whose calls went through two proxies, whose seq numbers clash), so nothing depends on the
order they arrive in, and decides what of each call goes into the trees: exact ids only (an upstream
call's, or a failed call's prompt, which goes in as context); re-encoded ids and calls without prompt ids
are kept out and counted by kind.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from clawpipe.errors import TreeError
from clawpipe.schemas import CallStatus, TokenSource

REQUIRED = ("call_id", "rollout_id", "prompt_token_ids")
OPTIONAL: dict[str, pa.DataType] = {
    "choice_index": pa.int32(),
    "group_id": pa.string(),
    "sample_idx": pa.int32(),
    "seq": pa.int64(),
    "t_start": pa.timestamp("us", tz="UTC"),
    "status": pa.string(),
    "spliced_tokens": pa.int32(),
    "policy_version": pa.int64(),
    "completion_token_ids": pa.list_(pa.int32()),
    "completion_logprobs": pa.list_(pa.float32()),
    "finish_reason": pa.string(),
    "token_source": pa.string(),
    "reward": pa.float64(),
}
# order_seq is seq, or null for a rollout whose seq numbers clash (see _order_seq): t_start orders those
SORT_KEYS = ("group_key", "sample_idx", "rollout_id", "order_seq", "t_start", "seq", "call_id", "choice_index")


@dataclass
class Lists:
    """A list<...> column as flat numpy values plus per-row start and length (nulls have length 0)."""

    values: np.ndarray
    offset: np.ndarray
    length: np.ndarray

    @classmethod
    def of(cls, col: pa.ChunkedArray | pa.Array, dtype: type, order: np.ndarray) -> Lists:
        """The column's lists, rows permuted by ``order`` (values stay where they are: no copy of the ids)."""
        arr = col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col
        arr = arr.cast(pa.list_(pa.from_numpy_dtype(dtype)))
        length = pc.fill_null(pc.list_value_length(arr), 0).to_numpy().astype(np.int64)
        offsets = arr.offsets.to_numpy().astype(np.int64)[:-1] if len(arr) else np.zeros(0, np.int64)
        values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
        return cls(values, offsets[order], length[order])


@dataclass
class CallBatch:
    """A sorted batch of call rows with everything the trees need as numpy arrays."""

    table: pa.Table
    prompt: Lists
    completion: Lists
    logprobs: Lists
    glen: np.ndarray  # completion tokens generated in the tree (0 for failed calls: their prompt is context)
    in_tree: np.ndarray  # bool
    failed: np.ndarray  # status other than ok
    truncated: np.ndarray
    retokenized: np.ndarray  # ids re-encoded by the proxy, not the ones sampled: kept out
    no_ids: np.ndarray  # no prompt ids at all (null or empty): kept out
    call_code: np.ndarray
    rollout_code: np.ndarray
    rollout_ids: list[str]
    group_code: np.ndarray  # per row: index into group_keys
    group_keys: list[str]  # group_key() of each group
    reward_of_rollout: np.ndarray  # NaN where unknown
    spliced: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64), repr=False)  # per row

    def key_length(self, r: int) -> int:
        """Tokens in row r's sequence (prompt + generated completion)."""
        return int(self.prompt.length[r]) + int(self.glen[r])

    def key(self, r: int) -> bytes:
        """Row r's sequence (prompt + generated completion) as big-endian uint32 bytes, written from the ids
        where they lie when the builder asks for it (no big-endian copy of the whole batch's ids is held)."""
        ps, pl = int(self.prompt.offset[r]), int(self.prompt.length[r])
        cs, gl = int(self.completion.offset[r]), int(self.glen[r])
        out = np.empty(pl + gl, dtype=">u4")
        out[:pl] = self.prompt.values[ps : ps + pl].view(np.uint32)
        out[pl:] = self.completion.values[cs : cs + gl].view(np.uint32)
        return out.tobytes()


def group_keys(group_id: pa.ChunkedArray, rollout_id: pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
    """Per row: the real group id (null when the rollout has none: null or empty) and the group key.

    A rollout without a group forms a group of its own. Keys are ``g:<group_id>`` or ``r:<rollout_id>``
    (as in sql/trees/calls.sql): ids are free text, so a groupless rollout named like a group must not
    take that group's key.
    """
    gid = group_id.combine_chunks().cast(pa.string())
    gid = pc.if_else(pc.fill_null(pc.equal(gid, ""), False), pa.scalar(None, pa.string()), gid)
    rid = rollout_id.combine_chunks().cast(pa.string())
    key = pc.coalesce(pc.binary_join_element_wise("g:", gid, ""), pc.binary_join_element_wise("r:", rid, ""))
    return gid, key


def _order_seq(calls: pa.Table) -> pa.Array:
    """Per row: its seq, or null where the rollout's seq numbers clash (two calls with one seq).

    Each proxy numbers a rollout's calls from 0 as they reach it, so the calls of a rollout that went through
    two proxies (or through one restarted mid-rollout) share numbers: ordered by seq, a later call of one
    proxy ranks before earlier calls of the other, and a re-encoded answer reads as a retry. Such a rollout
    is ordered by t_start (when the proxy took the request, on the machine's clock), then seq; any other
    keeps seq first, the exact order of its one proxy.
    """
    keyed = pa.table({"rollout_id": calls["rollout_id"], "seq": calls["seq"], "call_id": calls["call_id"]})
    per_seq = (
        keyed.filter(pc.is_valid(keyed["seq"]))
        .group_by(["rollout_id", "seq"])
        .aggregate([("call_id", "count_distinct")])
    )
    clashing = pc.unique(per_seq.filter(pc.greater(per_seq["call_id_count_distinct"], 1))["rollout_id"])
    if not len(clashing):
        return calls["seq"].combine_chunks()
    ambiguous = pc.is_in(calls["rollout_id"], value_set=clashing)
    return pc.if_else(ambiguous, pa.scalar(None, pa.int64()), calls["seq"]).combine_chunks()


def prepare(calls: pa.Table) -> CallBatch:
    """The rows sorted into rank order, with what the trees need of them as numpy arrays."""
    missing = [c for c in REQUIRED if c not in calls.column_names]
    if missing:
        raise TreeError(f"tree input lacks columns {missing}; select calls with sql/trees/calls.sql")
    for name, typ in OPTIONAL.items():
        if name not in calls.column_names:
            calls = calls.append_column(name, pa.nulls(len(calls), typ))
    group_id, key = group_keys(calls["group_id"], calls["rollout_id"])
    calls = calls.set_column(calls.column_names.index("group_id"), "group_id", group_id)
    if "group_key" in calls.column_names:
        calls = calls.drop_columns(["group_key"])
    calls = calls.append_column("group_key", key)
    if "order_seq" in calls.column_names:
        calls = calls.drop_columns(["order_seq"])
    calls = calls.append_column("order_seq", _order_seq(calls))
    keys = calls.select(list(SORT_KEYS))
    order = pc.sort_indices(keys, sort_keys=[(k, "ascending", "at_end") for k in SORT_KEYS])
    lists = ("prompt_token_ids", "completion_token_ids", "completion_logprobs")
    prompt = Lists.of(calls["prompt_token_ids"], np.int32, order.to_numpy())
    completion = Lists.of(calls["completion_token_ids"], np.int32, order.to_numpy())
    logprobs = Lists.of(calls["completion_logprobs"], np.float32, order.to_numpy())
    has_ids = pc.is_valid(calls["prompt_token_ids"]).to_numpy(zero_copy_only=False)[order.to_numpy()]
    calls = calls.drop_columns(list(lists)).take(order).combine_chunks()
    status = calls["status"].to_numpy(zero_copy_only=False)
    source = calls["token_source"].to_numpy(zero_copy_only=False)
    finish = calls["finish_reason"].to_numpy(zero_copy_only=False)
    failed = np.array([s is not None and s != CallStatus.ok for s in status], dtype=bool)
    truncated = np.array([f == "length" for f in finish], dtype=bool)
    # Exact ids are the ones the engine saw: an upstream call's, or a failed call's prompt ids (taken from
    # its request: token_source stays none there, as nothing was sampled). Re-encoded ids are not exact.
    retokenized = np.array([s == TokenSource.retokenized for s in source], dtype=bool)
    # an empty prompt id list is no ids either: an engine always has a prompt (a template, a BOS), so a
    # completion after [] would be trained as if sampled from nothing
    no_ids = ~retokenized & (~has_ids | (prompt.length == 0))
    sampled = np.array([s == TokenSource.upstream or s is None for s in source], dtype=bool)
    glen = np.where(failed | ~sampled, 0, completion.length)
    in_tree = ~retokenized & ~no_ids & (prompt.length + glen > 0)

    def codes(col: pa.ChunkedArray) -> tuple[np.ndarray, list[str]]:
        enc = pc.dictionary_encode(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
        return enc.indices.to_numpy().astype(np.int64), enc.dictionary.to_pylist()

    call_code, _ = codes(calls["call_id"])
    rollout_code, rollout_ids = codes(calls["rollout_id"])
    group_code, keys_of_groups = codes(calls["group_key"])
    reward = pc.fill_null(calls["reward"], np.nan).to_numpy()
    reward_of_rollout = np.full(len(rollout_ids), np.nan)
    reward_of_rollout[rollout_code[::-1]] = reward[::-1]  # the first row's reward per rollout
    return CallBatch(
        table=calls,
        prompt=prompt,
        completion=completion,
        logprobs=logprobs,
        glen=glen,
        in_tree=in_tree,
        failed=failed,
        truncated=truncated,
        retokenized=retokenized,
        no_ids=no_ids,
        call_code=call_code,
        rollout_code=rollout_code,
        rollout_ids=rollout_ids,
        group_code=group_code,
        group_keys=keys_of_groups,
        reward_of_rollout=reward_of_rollout,
        spliced=pc.fill_null(calls["spliced_tokens"], 0).to_numpy().astype(np.int64),
    )
