-- Training rollouts of one iteration landed so far, per group (latest attempt of each rollout): the async
-- trainer takes an iteration once every one of its groups is complete.
-- include: common/latest_rollouts
select
    group_id,
    count(*) as n_rollouts
from latest_rollouts
where not coalesce(eval, false)
group by group_id
order by group_id
