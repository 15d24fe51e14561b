-- Rollouts of one iteration that may be trained on (evaluation rollouts excluded; latest attempt wins).
-- include: common/latest_rollouts
select rollout_id, group_id, harness, reward, status
from latest_rollouts
where not coalesce(eval, false)
