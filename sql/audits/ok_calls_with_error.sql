-- A call that ended ok carries no error text (a stream cut by an error event lands as upstream_error).
select call_id, choice_index, run_id, iteration, rollout_id, api, http_status, error
from model_calls
where status = 'ok' and error is not null
order by run_id, iteration, call_id, choice_index
