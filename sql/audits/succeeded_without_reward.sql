-- Every succeeded rollout has a reward.
select rollout_id, run_id, iteration, harness, task_id
from rollouts
where status = 'succeeded' and reward is null
order by run_id, iteration, rollout_id
