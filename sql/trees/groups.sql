-- Groups of one run iteration with their call count and token volume, to plan tree building in
-- memory-bounded batches of whole groups, by group_key (sql/trees/calls.sql): a rollout without a group forms a
-- group of its own, apart from any group whose id equals its rollout id.
-- include: common/latest_rollouts
with runs as (
    select
        rollout_id,
        group_id
    from latest_rollouts
),

final as (
    select
        coalesce('g:' || nullif(runs.group_id, ''), 'r:' || model_calls.rollout_id) as group_key,
        any_value(nullif(runs.group_id, '')) as group_id,
        count(distinct model_calls.rollout_id) as n_rollouts,
        count(*) as n_rows,
        sum(coalesce(len(model_calls.prompt_token_ids), 0) + coalesce(len(model_calls.completion_token_ids), 0))
            as n_tokens
    from model_calls
    left join runs using (rollout_id)
    where model_calls.run_id = $run_id and model_calls.iteration = $iteration
    group by 1
)

select *
from final
order by group_key
