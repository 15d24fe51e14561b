-- Trees of a run (optionally one iteration and scope) with their sizes and branch counts, for
-- `clawpipe trees list`. A negative `$iteration` or an empty `$scope` matches all.
select
    iteration,
    tree_id,
    scope,
    n_calls,
    n_seqs,
    flattened_tokens,
    unique_tokens,
    round(redundancy, 2) as redundancy,
    n_leaves,
    branches_retry + branches_choice + branches_rewrite + branches_subagent + branches_drift + branches_rollout
        as branches,
    drift_count,
    failed_calls,
    kept_out_retokenized,
    kept_out_no_ids
from tree_stats
where run_id = $run_id
    and ($iteration < 0 or iteration = $iteration)
    and ($scope = '' or scope = $scope)
order by iteration, scope desc, tree_id
