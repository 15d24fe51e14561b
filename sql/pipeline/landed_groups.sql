-- Training rollouts of one iteration landed so far, per group (latest attempt of each rollout): the async
-- trainer takes an iteration once every one of its groups is complete. A rollout without a group (null or empty
-- group_id) is a group of its own (group_id null), as in training, never counted into another's group.
-- include: common/latest_rollouts
select
    any_value(nullif(group_id, '')) as group_id,
    count(*) as n_rollouts
from latest_rollouts
where not coalesce(eval, false)
group by coalesce('g:' || nullif(group_id, ''), 'r:' || rollout_id)
order by coalesce('g:' || nullif(group_id, ''), 'r:' || rollout_id)
