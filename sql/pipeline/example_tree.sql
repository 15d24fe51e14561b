-- The rollout tree with the most nodes in one run iteration: the one the iteration's summary renders.
select tree_id
from tree_stats
where run_id = $run_id and iteration = $iteration and scope = 'rollout'
order by n_nodes desc, tree_id
limit 1
