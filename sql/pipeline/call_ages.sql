-- Trainable calls (call x choice: ok, with completion token ids) of one iteration's training rollouts, counted
-- by the policy_version that sampled them: the async loop's staleness histogram and drop count. Calls of a
-- rollout with no result row (cut off by a kill, rerun under a new id) are not trained, so not counted.
-- include: common/latest_rollouts
select
    c.policy_version,
    count(*) as n_calls
from model_calls as c
semi join latest_rollouts as r on c.rollout_id = r.rollout_id and not coalesce(r.eval, false)
where
    c.run_id = $run_id
    and c.iteration = $iteration
    and c.status = 'ok'
    and len(c.completion_token_ids) > 0
group by c.policy_version
order by c.policy_version
