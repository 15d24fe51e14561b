-- Every call belongs to a landed rollout: calls whose rollout_id has no rollouts row. Left out: the calls of an
-- attempt cut off by a kill (it never wrote a result row) whose rollout then ran again in the same run and
-- iteration under a later attempt id (`<id>.a<N>`, clawpipe/pipeline/attempts.py). Those calls stay in
-- model_calls for queries; no tree or training step uses them.
with orphans as (
    select c.call_id, c.choice_index, c.run_id, c.iteration, c.rollout_id,
           regexp_replace(c.rollout_id, '\.a[0-9]+$', '') as spec_id,
           coalesce(try_cast(regexp_extract(c.rollout_id, '\.a([0-9]+)$', 1) as integer), 1) as attempt
    from model_calls as c
    anti join rollouts as r on r.rollout_id = c.rollout_id
),
attempted as (
    select run_id, iteration, regexp_replace(rollout_id, '\.a[0-9]+$', '') as spec_id,
           max(coalesce(try_cast(regexp_extract(rollout_id, '\.a([0-9]+)$', 1) as integer), 1)) as last_attempt
    from rollouts
    group by all
)
select o.call_id, o.choice_index, o.run_id, o.iteration, o.rollout_id
from orphans as o
left join attempted as a on a.run_id = o.run_id and a.iteration = o.iteration and a.spec_id = o.spec_id
where a.last_attempt is null or a.last_attempt <= o.attempt
order by o.run_id, o.iteration, o.rollout_id, o.call_id
