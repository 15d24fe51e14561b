-- Calls whose token_source claims the upstream's ids but that lack prompt or completion ids: a response
-- shape the landing did not read (they never become tree sequences without their prompt).
select call_id, choice_index, run_id, iteration, rollout_id, api, stream,
    prompt_token_ids is null as no_prompt_ids, completion_token_ids is null as no_completion_ids
from model_calls
where token_source = 'upstream'
    and status = 'ok'
    and (prompt_token_ids is null or completion_token_ids is null)
order by run_id, iteration, call_id, choice_index
