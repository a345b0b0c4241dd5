"""Versions on disk: the LMDB catalog (tables, immutable versions, the current
pointer), a version's manifest, the data directory's files and locks.

Entry points: catalog.Catalog, version.TableVersion, data_dir.private_dirs.
"""
