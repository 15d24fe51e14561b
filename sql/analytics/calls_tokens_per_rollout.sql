-- Calls, choices and tokens per rollout, with the rollout's harness, status and reward.
-- Parameters: $run_id, $iteration (NULL: all).
with calls as (
    select
        rollout_id,
        run_id,
        iteration,
        count(*) filter (where choice_index = 0) as calls,
        count(*) as call_choices,
        (sum(prompt_tokens) filter (where choice_index = 0))::bigint as prompt_tokens,
        sum(completion_tokens)::bigint as completion_tokens,
        count(*) filter (where choice_index = 0 and token_source = 'retokenized') as retokenized_calls,
        count(*) filter (where choice_index = 0 and status <> 'ok') as failed_calls,
        sum(latency_ms) filter (where choice_index = 0) as total_latency_ms
    from model_calls
    where ($run_id is null or run_id = $run_id) and ($iteration is null or iteration = $iteration)
    group by all
),

final as (
    select
        c.*,
        r.harness,
        r.status as rollout_status,
        r.reward
    from calls as c
    left join rollouts as r on r.rollout_id = c.rollout_id
)

select * from final
order by run_id, iteration, rollout_id
