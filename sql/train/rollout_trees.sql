-- Whether the rollout-scope trees of one iteration were built (side-call exclusion reads them).
select count(*) > 0 as built
from tree_nodes
where run_id = $run_id and iteration = $iteration and scope = 'rollout'
