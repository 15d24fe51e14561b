-- Rollouts of one iteration that may be trained on (evaluation rollouts excluded; latest attempt wins).
select rollout_id, group_id, harness, reward, status
from rollouts
where run_id = $run_id and iteration = $iteration and not coalesce(eval, false)
qualify row_number() over (partition by rollout_id order by attempt desc nulls last) = 1
