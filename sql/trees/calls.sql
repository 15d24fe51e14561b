-- Input of the tree builder: every call x choice of one run iteration with its rollout's group, reward and
-- order (clawpipe.trees.forest). `$group_ids` restricts to some groups (tree building goes group by group
-- to bound memory); `$all_groups` = true ignores it. A rollout without a group (null or empty group_id) forms a
-- group of its own: group_key tells `g:<group_id>` from `r:<rollout_id>`, so a groupless rollout whose id is
-- another rollout's group id never joins that group; group_id stays the real one (null without a group).
-- include: common/latest_rollouts
with calls as (
    select
        call_id,
        choice_index,
        rollout_id,
        seq,
        t_start,
        status,
        policy_version,
        prompt_token_ids,
        completion_token_ids,
        completion_logprobs,
        finish_reason,
        token_source,
        spliced_tokens
    from model_calls
    where run_id = $run_id and iteration = $iteration
),

runs as (
    select
        rollout_id,
        group_id,
        sample_idx,
        reward,
        status as rollout_status
    from latest_rollouts
),

final as (
    select
        calls.*,
        nullif(runs.group_id, '') as group_id,
        coalesce('g:' || nullif(runs.group_id, ''), 'r:' || calls.rollout_id) as group_key,
        runs.sample_idx,
        runs.reward,
        runs.rollout_status
    from calls
    left join runs using (rollout_id)
)

select *
from final
where $all_groups or list_contains($group_ids, group_key)
order by group_key, sample_idx nulls last, rollout_id, seq nulls last, t_start nulls last, call_id, choice_index
