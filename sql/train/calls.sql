-- Trainable call sequences (call x choice) of one iteration: ok calls with upstream token ids.
select call_id, choice_index, rollout_id, policy_version,
       prompt_token_ids, completion_token_ids, completion_logprobs
from model_calls
where run_id = $run_id and iteration = $iteration
  and status = 'ok'
  and (token_source = 'upstream' or ($include_retokenized and token_source = 'retokenized'))
  and len(completion_token_ids) > 0
order by rollout_id, seq, call_id, choice_index
