-- Training rollouts of one iteration landed so far, per group (latest attempt of each rollout): the async
-- trainer takes an iteration once every one of its groups is complete.
with latest as (
    select
        rollout_id,
        group_id
    from rollouts
    where run_id = $run_id and iteration = $iteration and not coalesce(eval, false)
    qualify row_number() over (partition by rollout_id order by attempt desc nulls last) = 1
)

select
    group_id,
    count(*) as n_rollouts
from latest
group by group_id
order by group_id
