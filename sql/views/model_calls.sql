-- One row per model call and choice (schemas.MODEL_CALLS), deduplicated at landing.
-- Over every Parquet part of the lake; `lake_root` is set by clawpipe.tables.connect.
create or replace view model_calls as
select *
from read_parquet(
    getvariable('lake_root') || '/model_calls/run_id=*/iteration=*/*.parquet',
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'run_id': 'VARCHAR', 'iteration': 'INTEGER'}
)
