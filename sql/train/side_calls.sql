-- Side calls to leave out of training (TrainConfig.exclude_side_calls_harnesses): the call x choice rows of
-- rollouts whose harness is listed in `$harnesses` that lie in a side lineage of the ROLLOUT-scope tree.
--
-- A side call (a title, a memory extraction, a sub-agent) diverges from the main trajectory in context
-- tokens (another system prompt), and the tree builder labels that branch 'subagent'. The builder labels
-- every child of a fork but the one with the EARLIEST call, so a side call made before the first main call
-- (a title request racing the first turn) gets the main lineage labelled 'subagent' instead. The main
-- lineage of a fork is therefore chosen here among its lineages (the unlabelled child and its 'subagent'
-- siblings), in this order:
--   1. the lineage holding both the first and the last call of the fork (interleaved sub-agents, side
--      calls in the middle: the main trajectory starts and ends the rollout);
--   2. the lineage with the most calls (a title call before or a memory extraction after a multi-turn
--      trajectory);
--   3. the lineage with the longest sequence (the agent's prompt carries its tools), then the one holding
--      the latest call.
-- Every call in the other lineages of the fork is a side call. Nodes are numbered in preorder, so the
-- subtree of node n is [n, first later node with depth <= depth(n)). A call sits where its path ends (the
-- trees room's tree_sequences), so an identical sample of another call sits where that call does.
-- include: common/latest_rollouts
with runs as (
    select
        rollout_id,
        harness
    from latest_rollouts
),

listed as (
    select
        rollout_id,
        'rollout:' || rollout_id as tree_id
    from runs
    where list_contains($harnesses, harness)
),

nodes as (
    select
        listed.rollout_id,
        tree_nodes.tree_id,
        tree_nodes.node_id,
        tree_nodes.parent_id,
        tree_nodes.depth,
        tree_nodes.generated,
        tree_nodes.call_id,
        tree_nodes.choice_index,
        tree_nodes.branch_cause
    from tree_nodes
    inner join listed on tree_nodes.tree_id = listed.tree_id
    where tree_nodes.run_id = $run_id and tree_nodes.iteration = $iteration and tree_nodes.scope = 'rollout'
),

forks as (
    select distinct
        tree_id,
        parent_id
    from nodes
    where branch_cause = 'subagent'
),

lineages as (
    select
        child.rollout_id,
        child.tree_id,
        child.parent_id as fork,
        child.node_id,
        coalesce(
            (
                select min(later.node_id)
                from nodes as later
                where later.tree_id = child.tree_id and later.node_id > child.node_id and later.depth <= child.depth
            ),
            2147483647
        ) as node_end
    from nodes as child
    inner join forks on child.tree_id = forks.tree_id and child.parent_id = forks.parent_id
    where child.branch_cause is null or child.branch_cause = 'subagent'
),

clashing as (
    -- rollouts whose calls went through two proxies (or a restarted one): each numbers a rollout's calls
    -- from 0, so two calls share a seq, and such a rollout is ranked by t_start (as the tree builder does)
    select distinct model_calls.rollout_id
    from model_calls
    inner join listed on model_calls.rollout_id = listed.rollout_id
    where model_calls.run_id = $run_id and model_calls.iteration = $iteration and model_calls.seq is not null
    group by model_calls.rollout_id, model_calls.seq
    having count(distinct model_calls.call_id) > 1
),

calls as (
    -- each call x choice of the listed rollouts where its path ends in its rollout tree (tree_sequences)
    select
        tree_sequences.call_id,
        tree_sequences.choice_index,
        tree_sequences.rollout_id,
        tree_sequences.node_id,
        tree_sequences.n_prompt + tree_sequences.n_generated as n_tokens,
        row_number() over (
            partition by tree_sequences.rollout_id
            order by case when clashing.rollout_id is null then model_calls.seq end nulls last,
                model_calls.t_start nulls last, model_calls.seq nulls last, tree_sequences.call_id,
                tree_sequences.choice_index
        ) as call_rank
    from tree_sequences
    inner join listed on tree_sequences.tree_id = listed.tree_id
    left join clashing on tree_sequences.rollout_id = clashing.rollout_id
    left join model_calls
        on
            tree_sequences.call_id = model_calls.call_id
            and tree_sequences.choice_index = model_calls.choice_index
            and model_calls.run_id = $run_id
            and model_calls.iteration = $iteration
    where tree_sequences.run_id = $run_id and tree_sequences.iteration = $iteration and tree_sequences.scope = 'rollout'
),

members as (
    select
        lineages.tree_id,
        lineages.fork,
        lineages.node_id as lineage,
        calls.call_id,
        calls.choice_index,
        calls.call_rank,
        calls.n_tokens
    from lineages
    inner join calls
        on
            lineages.rollout_id = calls.rollout_id
            and calls.node_id >= lineages.node_id
            and calls.node_id < lineages.node_end
),

scored as (
    select
        tree_id,
        fork,
        lineage,
        count(*) as n_calls,
        max(n_tokens) as longest,
        min(call_rank) as first_rank,
        max(call_rank) as last_rank
    from members
    group by tree_id, fork, lineage
),

spans as (
    select
        *,
        (
            first_rank = min(first_rank) over (partition by tree_id, fork)
            and last_rank = max(last_rank) over (partition by tree_id, fork)
        ) as spans_fork
    from scored
),

picked as (
    select
        tree_id,
        fork,
        lineage,
        row_number() over (
            partition by tree_id, fork
            order by spans_fork desc, n_calls desc, longest desc, last_rank desc
        ) as pick
    from spans
)

select distinct
    members.call_id,
    members.choice_index
from members
inner join picked using (tree_id, fork, lineage)
where picked.pick > 1
order by members.call_id, members.choice_index
