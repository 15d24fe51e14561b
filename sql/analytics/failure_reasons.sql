-- Why things failed, most frequent first: rollouts not succeeded, calls not ok, and landing rejects.
-- Parameters: $run_id (NULL: every run; rejects carry no run and are always listed).
with rollout_failures as (
    select
        'rollout' as level,
        run_id,
        status,
        coalesce(left(split_part(error, chr(10), 1), 200), 'exit code ' || exit_code::varchar, status) as reason,
        count(*) as n
    from rollouts
    where status <> 'succeeded' and ($run_id is null or run_id = $run_id)
    group by all
),

call_failures as (
    select
        'call' as level,
        run_id,
        status,
        coalesce(left(split_part(error, chr(10), 1), 200), 'http ' || http_status::varchar, status) as reason,
        count(*) as n
    from model_calls
    where choice_index = 0 and status <> 'ok' and ($run_id is null or run_id = $run_id)
    group by all
),

landing_rejects as (
    select
        'reject' as level,
        null::varchar as run_id,
        'rejected' as status,
        reason,
        count(*) as n
    from rejects
    group by all
),

final as (
    select * from rollout_failures
    union all by name
    select * from call_failures
    union all by name
    select * from landing_rejects
)

select * from final
order by n desc, level, reason
