-- Share of calls whose token ids were re-encoded by clawpipe (or missing), per run and iteration.
-- Parameters: $run_id (NULL: every run).
with calls as (
    select run_id, iteration, token_source
    from model_calls
    where choice_index = 0 and ($run_id is null or run_id = $run_id)
),

final as (
    select
        run_id,
        iteration,
        count(*) as calls,
        count(*) filter (where token_source = 'retokenized') as retokenized_calls,
        count(*) filter (where token_source = 'none') as calls_without_ids,
        count(*) filter (where token_source = 'retokenized') / count(*) as retokenized_rate
    from calls
    group by all
)

select * from final
order by run_id, iteration
