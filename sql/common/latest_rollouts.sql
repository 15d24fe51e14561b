-- The rollouts of one run iteration, one row each: the latest attempt of a rollout that was retried.
-- Included as the CTE `latest_rollouts` by the files that say `-- include: common/latest_rollouts`.
select *
from rollouts
where run_id = $run_id and iteration = $iteration
qualify row_number() over (partition by rollout_id order by attempt desc nulls last) = 1
