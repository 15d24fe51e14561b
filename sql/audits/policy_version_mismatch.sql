-- The engine reported a policy_version other than the proxy's stamp (the lake keeps the engine's; a publish
-- the proxy was not told of, or a stamp set by hand).
select call_id, choice_index, run_id, iteration, rollout_id, policy_version, proxy_policy_version
from model_calls
where proxy_policy_version is not null
    and policy_version is distinct from proxy_policy_version
order by run_id, iteration, call_id, choice_index
