-- Where each call x choice lies in the prefix trees: its tree and end node (schemas.TREE_SEQUENCES).
-- Over every Parquet part of the lake; `lake_root` is set by clawpipe.tables.connect.
create or replace view tree_sequences as
select *
from read_parquet(
    getvariable('lake_root') || '/tree_sequences/run_id=*/iteration=*/*.parquet',
    hive_partitioning = true,
    union_by_name = true,
    hive_types = {'run_id': 'VARCHAR', 'iteration': 'INTEGER'}
)
