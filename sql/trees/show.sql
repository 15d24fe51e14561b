-- Nodes of one tree, parent-first, for rendering (`clawpipe trees show`). Empty `$run_id` matches any run;
-- a negative `$iteration` matches any iteration.
select *
from tree_nodes
where tree_id = $tree_id
    and ($run_id = '' or run_id = $run_id)
    and ($iteration < 0 or iteration = $iteration)
order by run_id, iteration, node_id
