"""The model side: Engram layers (layer.EngramLayer, v41_layer.V41EngramLayer),
hooks onto an existing model (attach), the per-worker HBM cache (hbm_cache),
the queue of prepared steps (step_queue), in-process tables (in_process_table), the
RowSource contract (source) and demo models.
"""
