-- Nodes of the trees to train on, parent-first within each tree.
select tree_id, node_id, parent_id, token_ids, rollout_ids
from tree_nodes
where run_id = $run_id and iteration = $iteration and scope = $scope
order by tree_id, node_id
