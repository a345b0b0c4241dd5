from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListTablesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListTablesResponse(_message.Message):
    __slots__ = ("tables",)
    TABLES_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableInfo]
    def __init__(self, tables: _Optional[_Iterable[_Union[TableInfo, _Mapping]]] = ...) -> None: ...

class DescribeTableRequest(_message.Message):
    __slots__ = ("table",)
    TABLE_FIELD_NUMBER: _ClassVar[int]
    table: str
    def __init__(self, table: _Optional[str] = ...) -> None: ...

class Arena(_message.Message):
    __slots__ = ("path", "slots", "full_resident", "size_bytes", "instance", "lease_board", "lease_board_entries", "index", "cold_dir", "cold_direct", "layout", "split_bytes")
    PATH_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    FULL_RESIDENT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_FIELD_NUMBER: _ClassVar[int]
    LEASE_BOARD_FIELD_NUMBER: _ClassVar[int]
    LEASE_BOARD_ENTRIES_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    COLD_DIR_FIELD_NUMBER: _ClassVar[int]
    COLD_DIRECT_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_BYTES_FIELD_NUMBER: _ClassVar[int]
    path: str
    slots: int
    full_resident: bool
    size_bytes: int
    instance: str
    lease_board: str
    lease_board_entries: int
    index: str
    cold_dir: str
    cold_direct: bool
    layout: str
    split_bytes: int
    def __init__(self, path: _Optional[str] = ..., slots: _Optional[int] = ..., full_resident: _Optional[bool] = ..., size_bytes: _Optional[int] = ..., instance: _Optional[str] = ..., lease_board: _Optional[str] = ..., lease_board_entries: _Optional[int] = ..., index: _Optional[str] = ..., cold_dir: _Optional[str] = ..., cold_direct: _Optional[bool] = ..., layout: _Optional[str] = ..., split_bytes: _Optional[int] = ...) -> None: ...

class TableInfo(_message.Message):
    __slots__ = ("table", "version", "rows", "row_format", "row_dim", "row_bytes", "spec_json", "layer_id", "arena", "max_prefetch_steps", "checkpoint_json")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_FORMAT_FIELD_NUMBER: _ClassVar[int]
    ROW_DIM_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEC_JSON_FIELD_NUMBER: _ClassVar[int]
    LAYER_ID_FIELD_NUMBER: _ClassVar[int]
    ARENA_FIELD_NUMBER: _ClassVar[int]
    MAX_PREFETCH_STEPS_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_JSON_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    rows: int
    row_format: str
    row_dim: int
    row_bytes: int
    spec_json: str
    layer_id: int
    arena: Arena
    max_prefetch_steps: int
    checkpoint_json: str
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ..., rows: _Optional[int] = ..., row_format: _Optional[str] = ..., row_dim: _Optional[int] = ..., row_bytes: _Optional[int] = ..., spec_json: _Optional[str] = ..., layer_id: _Optional[int] = ..., arena: _Optional[_Union[Arena, _Mapping]] = ..., max_prefetch_steps: _Optional[int] = ..., checkpoint_json: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("table", "version", "ids")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    ids: bytes
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ..., ids: _Optional[bytes] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("rows", "row_bytes", "version")
    ROWS_FIELD_NUMBER: _ClassVar[int]
    ROW_BYTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    rows: bytes
    row_bytes: int
    version: int
    def __init__(self, rows: _Optional[bytes] = ..., row_bytes: _Optional[int] = ..., version: _Optional[int] = ...) -> None: ...

class PrefetchRequest(_message.Message):
    __slots__ = ("table", "ids", "hint_only", "steps", "owner")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    IDS_FIELD_NUMBER: _ClassVar[int]
    HINT_ONLY_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    table: str
    ids: bytes
    hint_only: bool
    steps: int
    owner: bytes
    def __init__(self, table: _Optional[str] = ..., ids: _Optional[bytes] = ..., hint_only: _Optional[bool] = ..., steps: _Optional[int] = ..., owner: _Optional[bytes] = ...) -> None: ...

class PrefetchResponse(_message.Message):
    __slots__ = ("queued",)
    QUEUED_FIELD_NUMBER: _ClassVar[int]
    queued: int
    def __init__(self, queued: _Optional[int] = ...) -> None: ...

class ReloadRequest(_message.Message):
    __slots__ = ("table", "version")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ...) -> None: ...

class ReloadResponse(_message.Message):
    __slots__ = ("changed",)
    class Change(_message.Message):
        __slots__ = ("table", "old_version", "new_version")
        TABLE_FIELD_NUMBER: _ClassVar[int]
        OLD_VERSION_FIELD_NUMBER: _ClassVar[int]
        NEW_VERSION_FIELD_NUMBER: _ClassVar[int]
        table: str
        old_version: int
        new_version: int
        def __init__(self, table: _Optional[str] = ..., old_version: _Optional[int] = ..., new_version: _Optional[int] = ...) -> None: ...
    CHANGED_FIELD_NUMBER: _ClassVar[int]
    changed: _containers.RepeatedCompositeFieldContainer[ReloadResponse.Change]
    def __init__(self, changed: _Optional[_Iterable[_Union[ReloadResponse.Change, _Mapping]]] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TableStats(_message.Message):
    __slots__ = ("table", "version", "mode", "capacity", "resident", "hits", "misses", "promotions", "evictions", "leases_active", "leased_slots", "lease_refusals", "bytes_read", "plans", "prefetched", "fill_waits", "local_steps", "notes_dropped", "metadata_bytes", "notes_refused", "warmed", "note_rows_placed", "note_rows_refused", "steps_copied", "arena_page_bytes", "arena_huge_bytes", "notes_over_share")
    TABLE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    PROMOTIONS_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    LEASED_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LEASE_REFUSALS_FIELD_NUMBER: _ClassVar[int]
    BYTES_READ_FIELD_NUMBER: _ClassVar[int]
    PLANS_FIELD_NUMBER: _ClassVar[int]
    PREFETCHED_FIELD_NUMBER: _ClassVar[int]
    FILL_WAITS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    NOTES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    METADATA_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTES_REFUSED_FIELD_NUMBER: _ClassVar[int]
    WARMED_FIELD_NUMBER: _ClassVar[int]
    NOTE_ROWS_PLACED_FIELD_NUMBER: _ClassVar[int]
    NOTE_ROWS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    STEPS_COPIED_FIELD_NUMBER: _ClassVar[int]
    ARENA_PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    ARENA_HUGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    NOTES_OVER_SHARE_FIELD_NUMBER: _ClassVar[int]
    table: str
    version: int
    mode: str
    capacity: int
    resident: int
    hits: int
    misses: int
    promotions: int
    evictions: int
    leases_active: int
    leased_slots: int
    lease_refusals: int
    bytes_read: int
    plans: int
    prefetched: int
    fill_waits: int
    local_steps: int
    notes_dropped: int
    metadata_bytes: int
    notes_refused: int
    warmed: int
    note_rows_placed: int
    note_rows_refused: int
    steps_copied: int
    arena_page_bytes: int
    arena_huge_bytes: int
    notes_over_share: int
    def __init__(self, table: _Optional[str] = ..., version: _Optional[int] = ..., mode: _Optional[str] = ..., capacity: _Optional[int] = ..., resident: _Optional[int] = ..., hits: _Optional[int] = ..., misses: _Optional[int] = ..., promotions: _Optional[int] = ..., evictions: _Optional[int] = ..., leases_active: _Optional[int] = ..., leased_slots: _Optional[int] = ..., lease_refusals: _Optional[int] = ..., bytes_read: _Optional[int] = ..., plans: _Optional[int] = ..., prefetched: _Optional[int] = ..., fill_waits: _Optional[int] = ..., local_steps: _Optional[int] = ..., notes_dropped: _Optional[int] = ..., metadata_bytes: _Optional[int] = ..., notes_refused: _Optional[int] = ..., warmed: _Optional[int] = ..., note_rows_placed: _Optional[int] = ..., note_rows_refused: _Optional[int] = ..., steps_copied: _Optional[int] = ..., arena_page_bytes: _Optional[int] = ..., arena_huge_bytes: _Optional[int] = ..., notes_over_share: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("tables", "uptime_s", "leases_active")
    TABLES_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    LEASES_ACTIVE_FIELD_NUMBER: _ClassVar[int]
    tables: _containers.RepeatedCompositeFieldContainer[TableStats]
    uptime_s: float
    leases_active: int
    def __init__(self, tables: _Optional[_Iterable[_Union[TableStats, _Mapping]]] = ..., uptime_s: _Optional[float] = ..., leases_active: _Optional[int] = ...) -> None: ...
