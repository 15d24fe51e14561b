-- One run iteration's training rollouts per harness (latest attempt of each): rollouts, reward mean and
-- standard deviation (population, as the trainer's reward/std/<harness>), model calls, prompt and completion
-- tokens (the calls' own counts, not their id lists, so the query stays cheap: a shared prefix counts once
-- per call), prompt ids the engine carried over from earlier completions (spliced), and the drift and
-- rewrite branches of the rollouts' trees.
-- include: common/latest_rollouts
with calls as (
    select
        rollout_id,
        count(*) filter (where choice_index = 0) as calls,
        sum(prompt_tokens) filter (where choice_index = 0) as prompt_tokens,
        sum(completion_tokens) as completion_tokens,
        sum(coalesce(spliced_tokens, 0)) filter (where choice_index = 0) as spliced_tokens
    from model_calls
    where run_id = $run_id and iteration = $iteration
    group by rollout_id
),

trees as (
    select
        rollout_id,
        sum(branches_drift) as drift_branches,
        sum(branches_rewrite) as rewrite_branches
    from tree_stats
    where run_id = $run_id and iteration = $iteration and scope = 'rollout'
    group by rollout_id
)

select
    r.harness,
    count(*) as rollouts,
    avg(coalesce(r.reward, 0)) as reward_mean,
    stddev_pop(coalesce(r.reward, 0)) as reward_std,
    coalesce(sum(c.calls), 0)::bigint as calls,
    coalesce(sum(c.prompt_tokens), 0)::bigint as prompt_tokens,
    coalesce(sum(c.completion_tokens), 0)::bigint as completion_tokens,
    coalesce(sum(c.spliced_tokens), 0)::bigint as spliced_tokens,
    coalesce(sum(t.drift_branches), 0)::bigint as drift_branches,
    coalesce(sum(t.rewrite_branches), 0)::bigint as rewrite_branches
from latest_rollouts as r
left join calls as c on r.rollout_id = c.rollout_id
left join trees as t on r.rollout_id = t.rollout_id
where not coalesce(r.eval, false) and r.status <> 'infra_error'
group by r.harness
order by r.harness
