-- One row per rollout (the latest attempt): rollout ids that occur more than once.
select rollout_id, count(*) as copies
from rollouts
group by rollout_id
having count(*) > 1
order by rollout_id
