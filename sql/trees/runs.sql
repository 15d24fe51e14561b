-- Runs that have built trees, newest id last, for `clawpipe trees list` to name when a run has none.
select distinct run_id
from tree_stats
order by run_id
