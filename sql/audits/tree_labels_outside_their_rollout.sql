-- Tree branch labels are decided within one rollout: the call a label names must be backed by an EARLIER
-- call of the SAME rollout (the trees room's tree_sequences say where each call's path ends). Offending:
--   retry  - no earlier call of the branch call's rollout ends below a sibling of the branch;
--   choice - no other choice of the branch call ends below a sibling of the branch;
--   drift  - the re-encoded call (drift_call_id) is not an earlier call of the same rollout.
-- Nodes are numbered in preorder, so the subtree of node n is [n, first later node with depth <= depth(n)).
-- Calls are ranked as the tree builder ranks them: by seq, but by t_start in a rollout whose calls went through
-- two proxies (or a restarted one), each numbering a rollout's calls from 0, so that two calls share a seq.
with per_call as (
    select
        run_id,
        iteration,
        call_id,
        any_value(rollout_id) as rollout_id,
        min(seq) as seq,
        min(t_start) as t_start
    from model_calls
    group by run_id, iteration, call_id
),

clashing as (
    select distinct
        run_id,
        iteration,
        rollout_id
    from per_call
    where seq is not null
    group by run_id, iteration, rollout_id, seq
    having count(*) > 1
),

calls as (
    select
        per_call.run_id,
        per_call.iteration,
        per_call.call_id,
        per_call.rollout_id,
        row_number() over (
            partition by per_call.run_id, per_call.iteration, per_call.rollout_id
            order by
                case when clashing.rollout_id is null then per_call.seq end nulls last,
                per_call.t_start nulls last,
                per_call.seq nulls last,
                per_call.call_id
        ) as call_rank
    from per_call
    left join clashing
        on
            per_call.run_id = clashing.run_id
            and per_call.iteration = clashing.iteration
            and per_call.rollout_id = clashing.rollout_id
),

labelled as (
    select
        run_id,
        iteration,
        tree_id,
        node_id,
        parent_id,
        branch_cause,
        call_id,
        choice_index,
        drift_call_id
    from tree_nodes
    where branch_cause in ('retry', 'choice', 'drift')
),

siblings as (
    select
        labelled.run_id,
        labelled.iteration,
        labelled.tree_id,
        labelled.node_id as branch,
        sibling.node_id as sibling,
        coalesce(
            (
                select min(later.node_id)
                from tree_nodes as later
                where
                    later.run_id = sibling.run_id
                    and later.iteration = sibling.iteration
                    and later.tree_id = sibling.tree_id
                    and later.node_id > sibling.node_id
                    and later.depth <= sibling.depth
            ),
            2147483647
        ) as sibling_end
    from labelled
    inner join tree_nodes as sibling
        on
            labelled.run_id = sibling.run_id
            and labelled.iteration = sibling.iteration
            and labelled.tree_id = sibling.tree_id
            and labelled.parent_id = sibling.parent_id
            and labelled.node_id <> sibling.node_id
    where labelled.branch_cause in ('retry', 'choice')
),

backed as (
    select distinct
        siblings.run_id,
        siblings.iteration,
        siblings.tree_id,
        siblings.branch
    from siblings
    inner join labelled
        on
            siblings.run_id = labelled.run_id
            and siblings.iteration = labelled.iteration
            and siblings.tree_id = labelled.tree_id
            and siblings.branch = labelled.node_id
    inner join calls as branch_call
        on
            labelled.run_id = branch_call.run_id
            and labelled.iteration = branch_call.iteration
            and labelled.call_id = branch_call.call_id
    inner join tree_sequences as below
        on
            siblings.run_id = below.run_id
            and siblings.iteration = below.iteration
            and siblings.tree_id = below.tree_id
            and below.node_id >= siblings.sibling
            and below.node_id < siblings.sibling_end
    inner join calls as other
        on
            below.run_id = other.run_id
            and below.iteration = other.iteration
            and below.call_id = other.call_id
    where
        other.rollout_id = branch_call.rollout_id
        and (
            (labelled.branch_cause = 'retry' and other.call_rank < branch_call.call_rank)
            or (
                labelled.branch_cause = 'choice'
                and below.call_id = labelled.call_id
                and below.choice_index <> labelled.choice_index
            )
        )
)

select
    labelled.run_id,
    labelled.iteration,
    labelled.tree_id,
    labelled.node_id,
    labelled.branch_cause,
    labelled.call_id,
    labelled.choice_index,
    labelled.drift_call_id,
    branch_call.rollout_id,
    drifted.rollout_id as drift_rollout_id
from labelled
left join calls as branch_call
    on
        labelled.run_id = branch_call.run_id
        and labelled.iteration = branch_call.iteration
        and labelled.call_id = branch_call.call_id
left join calls as drifted
    on
        labelled.run_id = drifted.run_id
        and labelled.iteration = drifted.iteration
        and labelled.drift_call_id = drifted.call_id
left join backed
    on
        labelled.run_id = backed.run_id
        and labelled.iteration = backed.iteration
        and labelled.tree_id = backed.tree_id
        and labelled.node_id = backed.branch
where
    (labelled.branch_cause in ('retry', 'choice') and backed.branch is null)
    or (
        labelled.branch_cause = 'drift'
        and (
            drifted.rollout_id is distinct from branch_call.rollout_id
            or drifted.call_rank >= branch_call.call_rank
            or drifted.call_rank is null
        )
    )
order by labelled.run_id, labelled.iteration, labelled.tree_id, labelled.node_id
