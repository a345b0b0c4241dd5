"""Writing table versions: from arrays (writer), checkpoint tensors (tensor_file),
whole Hugging Face checkpoints (checkpoint, read by tierstore.table.checkpoint), portable
zstd files (portable) and deterministic demo tables (demo_table).

Every writer stages a version and commits it in one catalog transaction: a
crash mid-ingest leaves the old version serving.
"""
