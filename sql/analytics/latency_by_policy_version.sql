-- Call latency percentiles (ms) per policy version and API; overhead = latency minus upstream time.
-- Parameters: $run_id (NULL: every run).
with calls as (
    select policy_version, api, latency_ms, upstream_ms
    from model_calls
    where choice_index = 0 and ($run_id is null or run_id = $run_id)
),

final as (
    select
        policy_version,
        api,
        count(*) as calls,
        quantile_cont(latency_ms, 0.5) as p50_ms,
        quantile_cont(latency_ms, 0.9) as p90_ms,
        quantile_cont(latency_ms, 0.99) as p99_ms,
        max(latency_ms) as max_ms,
        quantile_cont(latency_ms - upstream_ms, 0.5) as p50_overhead_ms
    from calls
    group by all
)

select * from final
order by policy_version, api
