-- One row per rollout (harness execution), the latest attempt (schemas.ROLLOUTS).
-- Over every Parquet part of the lake; `lake_root` is set by clawpipe.tables.connect.
create or replace view rollouts as
select *
from read_parquet(
    getvariable('lake_root') || '/rollouts/run_id=*/iteration=*/*.parquet',
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'run_id': 'VARCHAR', 'iteration': 'INTEGER'}
)
