-- Capture records and result lines that could not be landed, with the reason and source position.
create or replace view rejects as
select *
from read_parquet(getvariable('lake_root') || '/rejects/**/*.parquet', union_by_name = true)
