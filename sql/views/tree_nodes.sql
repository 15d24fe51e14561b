-- Nodes of the reconstructed prefix trees (schemas.TREE_NODES).
-- Over every Parquet part of the lake; `lake_root` is set by clawpipe.tables.connect.
create or replace view tree_nodes as
select *
from read_parquet(
    getvariable('lake_root') || '/tree_nodes/run_id=*/iteration=*/*.parquet',
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'run_id': 'VARCHAR', 'iteration': 'INTEGER'}
)
