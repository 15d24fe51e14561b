-- Completion token ids and their logprobs have equal length wherever logprobs exist.
select call_id, choice_index, run_id, iteration,
    len(completion_token_ids) as n_ids, len(completion_logprobs) as n_logprobs
from model_calls
where completion_logprobs is not null
    and len(completion_logprobs) is distinct from len(completion_token_ids)
order by run_id, iteration, call_id, choice_index
