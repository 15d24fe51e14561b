-- No call is landed twice: (call_id, choice_index) pairs that occur more than once.
select call_id, choice_index, count(*) as copies
from model_calls
group by call_id, choice_index
having count(*) > 1
order by call_id, choice_index
