"""Arrow schemas of every table, with one spelling per column across Python, SQL and Parquet.

Identity: experiment > run > iteration > group > rollout > call (docs/ARCHITECTURE.md). ``model_calls`` holds one
row per call and choice; ``rollouts`` one row per harness execution; ``tree_nodes``, ``tree_stats`` and
``tree_sequences`` the reconstructed prefix trees. Partition columns (run_id, iteration) are real columns
too, so a file read without hive partitioning still carries them.
"""

from __future__ import annotations

import enum

import pyarrow as pa

TS = pa.timestamp("us", tz="UTC")
IDS = pa.list_(pa.int32())
LOGPROBS = pa.list_(pa.float32())


class Api(enum.StrEnum):
    chat = "chat"
    completions = "completions"
    responses = "responses"
    messages = "messages"
    models = "models"


class CallStatus(enum.StrEnum):
    """Outcome of one model call as seen by the proxy."""

    ok = "ok"
    http_error = "http_error"  # the proxy or upstream answered 4xx/5xx
    upstream_error = "upstream_error"  # upstream unreachable (502) or timed out (504)
    cancelled = "cancelled"  # the client went away mid-response; the partial response is kept


class TokenSource(enum.StrEnum):
    upstream = "upstream"  # ids as sampled, returned by the upstream (vLLM return_token_ids)
    retokenized = "retokenized"  # ids re-encoded by clawpipe: never mixed in silently
    none = "none"  # no ids at all (error, or no tokenizer available)


class RolloutStatus(enum.StrEnum):
    succeeded = "succeeded"
    failed = "failed"
    timeout = "timeout"
    oom = "oom"
    crashed = "crashed"
    disk_quota = "disk_quota"  # the work dir and logs outgrew the harness's [resources] disk_mb
    infra_error = "infra_error"


MODEL_CALLS = pa.schema(
    [
        pa.field("call_id", pa.string(), nullable=False),
        pa.field("choice_index", pa.int32(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("seq", pa.int64()),
        pa.field("api", pa.string()),
        pa.field("path", pa.string()),
        pa.field("stream", pa.bool_()),
        pa.field("request", pa.string()),  # the harness's original JSON, as sent
        pa.field("request_changes", pa.string()),  # JSON: what the proxy added or changed
        pa.field("response", pa.string()),  # JSON; reassembled for streams
        pa.field("status", pa.string()),  # CallStatus
        pa.field("http_status", pa.int32()),
        pa.field("error", pa.string()),
        pa.field("model", pa.string()),
        pa.field("policy_version", pa.int64()),  # the engine's, where its response reports one
        pa.field("proxy_policy_version", pa.int64()),  # the proxy's stamp (audit: policy_version_mismatch)
        pa.field("prompt_token_ids", IDS),
        pa.field("completion_token_ids", IDS),
        pa.field("completion_logprobs", LOGPROBS),
        pa.field("finish_reason", pa.string()),
        pa.field("token_source", pa.string()),  # TokenSource
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("spliced_tokens", pa.int32()),  # prompt ids the engine took from the rollout's earlier completions
        pa.field("tool_calls", pa.string()),  # JSON list, OpenAI shape, or null
        pa.field("t_start", TS),
        pa.field("t_end", TS),
        pa.field("latency_ms", pa.float64()),
        pa.field("upstream_ms", pa.float64()),
        pa.field("segment", pa.string()),  # source capture segment (file name)
        pa.field("offset", pa.int64()),  # byte offset of the record in its segment
    ]
)

ROLLOUTS = pa.schema(
    [
        pa.field("rollout_id", pa.string(), nullable=False),
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("group_id", pa.string()),
        pa.field("harness", pa.string()),
        pa.field("task_set", pa.string()),
        pa.field("task_id", pa.string()),
        pa.field("sample_idx", pa.int32()),
        pa.field("backend", pa.string()),
        pa.field("status", pa.string()),  # RolloutStatus
        pa.field("exit_code", pa.int32()),
        pa.field("reward", pa.float64()),
        pa.field("reward_info", pa.string()),  # JSON
        pa.field("n_calls", pa.int32()),
        pa.field("started_at", TS),
        pa.field("ended_at", TS),
        pa.field("duration_s", pa.float64()),
        pa.field("stderr_tail", pa.string()),
        pa.field("error", pa.string()),  # infra error message, if any
        pa.field("attempt", pa.int32()),
        pa.field("policy_version", pa.int64()),
        pa.field("eval", pa.bool_()),  # greedy evaluation rollout, not for training
    ]
)

TREE_NODES = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("tree_id", pa.string(), nullable=False),
        pa.field("scope", pa.string()),  # rollout | group
        pa.field("node_id", pa.int32(), nullable=False),
        pa.field("parent_id", pa.int32()),  # -1 for children of the (empty) root
        pa.field("depth", pa.int32()),  # token offset of the node's first token
        pa.field("token_ids", IDS),
        pa.field("generated", pa.bool_()),  # a node never mixes generated and context tokens
        pa.field("logprobs", LOGPROBS),  # sampling logprobs of generated tokens, else null
        pa.field("call_id", pa.string()),  # call that generated the node (generated nodes)
        pa.field("choice_index", pa.int32()),
        pa.field("policy_version", pa.int64()),
        pa.field("rollout_ids", pa.list_(pa.string())),  # rollouts whose sequences pass through
        pa.field("n_seqs", pa.int32()),  # call sequences passing through the node
        pa.field("n_leaves", pa.int32()),
        pa.field("is_leaf", pa.bool_()),
        pa.field("reward", pa.float64()),  # leaves: the rollout's reward
        pa.field("branch_cause", pa.string()),  # why this node starts a new branch, or null
        pa.field("drift_call_id", pa.string()),  # drift: the earlier call whose completion was re-encoded
        # sequences that generated this node's tokens (identical samples of several calls/choices share a
        # node): the node's policy-gradient weight; 0 for context nodes (added by the trees room)
        pa.field("n_generated", pa.int32()),
    ]
)

TREE_STATS = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("tree_id", pa.string(), nullable=False),
        pa.field("scope", pa.string()),
        pa.field("group_id", pa.string()),
        pa.field("rollout_id", pa.string()),  # rollout scope only
        pa.field("n_calls", pa.int32()),
        pa.field("n_seqs", pa.int32()),
        pa.field("flattened_tokens", pa.int64()),
        pa.field("unique_tokens", pa.int64()),
        pa.field("redundancy", pa.float64()),
        pa.field("n_nodes", pa.int32()),
        pa.field("n_leaves", pa.int32()),
        pa.field("branches_retry", pa.int32()),
        pa.field("branches_choice", pa.int32()),
        pa.field("branches_rewrite", pa.int32()),
        pa.field("branches_subagent", pa.int32()),
        pa.field("branches_drift", pa.int32()),
        pa.field("branches_rollout", pa.int32()),  # group scope: rollouts diverging from the shared prompt
        pa.field("drift_count", pa.int32()),
        pa.field("failed_calls", pa.int32()),
        pa.field("truncated_calls", pa.int32()),
        pa.field("kept_out_retokenized", pa.int32()),  # calls kept out: ids re-encoded by the proxy, not sampled
        pa.field("kept_out_no_ids", pa.int32()),  # calls kept out: no prompt ids at all
        pa.field("spliced_tokens", pa.int64()),  # prompt ids the engine carried over from earlier completions
    ]
)

# The call-to-path link: each call x choice in a tree is the root-to-node path ending at ``node_id``
# (every sequence ends at a node boundary), written with the trees (one row per tree it is in).
TREE_SEQUENCES = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("tree_id", pa.string(), nullable=False),
        pa.field("scope", pa.string()),  # rollout | group
        pa.field("call_id", pa.string(), nullable=False),
        pa.field("choice_index", pa.int32(), nullable=False),
        pa.field("rollout_id", pa.string()),
        pa.field("node_id", pa.int32(), nullable=False),  # the node where the sequence ends
        pa.field("n_prompt", pa.int32()),  # prompt tokens: the path's first n_prompt tokens are context
        pa.field("n_generated", pa.int32()),  # completion tokens on the path (0 for a failed call's prompt)
        pa.field("policy_version", pa.int64()),
    ]
)

REJECTS = pa.schema(
    [
        pa.field("source", pa.string()),  # segment or results file
        pa.field("offset", pa.int64()),
        pa.field("reason", pa.string()),
        pa.field("record", pa.string()),  # what could be read of it, truncated
        pa.field("landed_at", TS),
    ]
)

TABLES: dict[str, pa.Schema] = {
    "model_calls": MODEL_CALLS,
    "rollouts": ROLLOUTS,
    "tree_nodes": TREE_NODES,
    "tree_stats": TREE_STATS,
    "tree_sequences": TREE_SEQUENCES,
    "rejects": REJECTS,
}
