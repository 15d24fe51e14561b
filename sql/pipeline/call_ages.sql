-- Trainable calls (call x choice: ok, with completion token ids) of one iteration's training rollouts, counted
-- by the policy_version that sampled them: the async loop's staleness histogram and drop count.
select
    c.policy_version,
    count(*) as n_calls
from model_calls as c
where
    c.run_id = $run_id
    and c.iteration = $iteration
    and c.status = 'ok'
    and len(c.completion_token_ids) > 0
    and not c.rollout_id like 'eval.%'
group by c.policy_version
order by c.policy_version
