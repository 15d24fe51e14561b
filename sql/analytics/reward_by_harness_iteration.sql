-- Reward and outcomes per run, harness and iteration; evaluation rollouts are reported apart.
-- Parameters: $run_id (NULL: every run).
with filtered as (
    select *
    from rollouts
    where $run_id is null or run_id = $run_id
),

final as (
    select
        run_id,
        harness,
        iteration,
        coalesce(eval, false) as eval,
        count(*) as rollouts,
        count(*) filter (where status = 'succeeded') as succeeded,
        avg(reward) as mean_reward,
        stddev_samp(reward) as std_reward,
        min(reward) as min_reward,
        max(reward) as max_reward
    from filtered
    group by all
)

select * from final
order by run_id, harness, iteration, eval
