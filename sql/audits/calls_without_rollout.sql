-- Every call belongs to a landed rollout: calls whose rollout_id has no rollouts row.
select c.call_id, c.choice_index, c.run_id, c.iteration, c.rollout_id
from model_calls as c
anti join rollouts as r on r.rollout_id = c.rollout_id
order by c.run_id, c.iteration, c.rollout_id, c.call_id
