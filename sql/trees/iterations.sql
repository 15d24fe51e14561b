-- Iterations of a run that have captured calls (tree building runs per iteration).
select distinct iteration
from model_calls
where run_id = $run_id
order by iteration
