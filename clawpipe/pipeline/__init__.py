"""The pipeline's library side: run config, run state, the services a run needs, and resource watching.

flows/ wires these into Prefect flows; nothing here imports prefect.
"""
