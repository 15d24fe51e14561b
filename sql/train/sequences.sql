-- Trainable call sequences (call x choice) of one iteration, in training order, each with its place in the
-- `$scope` trees (tree_sequences: its tree and the node where its path ends; null when the trees left it
-- out): ok calls with upstream token ids (or re-encoded ones with `$include_retokenized`).
with links as (
    select
        call_id,
        choice_index,
        tree_id,
        node_id,
        n_prompt
    from tree_sequences
    where run_id = $run_id and iteration = $iteration and scope = $scope
),

calls as (
    select
        call_id,
        choice_index,
        rollout_id,
        seq,
        policy_version,
        completion_logprobs,
        len(completion_token_ids) as n_completion
    from model_calls
    where
        run_id = $run_id
        and iteration = $iteration
        and status = 'ok'
        and (token_source = 'upstream' or ($include_retokenized and token_source = 'retokenized'))
        and len(completion_token_ids) > 0
)

select
    calls.call_id,
    calls.choice_index,
    calls.rollout_id,
    calls.policy_version,
    calls.completion_logprobs,
    calls.n_completion,
    links.tree_id,
    links.node_id,
    links.n_prompt
from calls
left join links on calls.call_id = links.call_id and calls.choice_index = links.choice_index
order by links.tree_id nulls last, calls.rollout_id, calls.seq nulls last, calls.call_id, calls.choice_index
