"""The wire, shared by the sidecar and its clients: the gRPC service
(tierstore.proto, stubs generated into tierstore_pb2*), the step socket's frames
(frames), and the limits both sides apply to either.
"""
__all__ = ["MAX_REQUEST_BYTES", "MAX_RESPONSE_BYTES", "MAX_REQUEST_IDS", "MAX_INLINE_BYTES"]

# Wire limits. gRPC's default receive limit is 4 MiB; a 4,096-token step of
# V4.1 hashes to 98k ids (786 KB), a long prefill to tens of MB, so requests
# may be 64 MiB. Inline Lookup responses carry rows and may be 256 MiB.
MAX_REQUEST_BYTES = 64 << 20
MAX_RESPONSE_BYTES = 256 << 20
MAX_REQUEST_IDS = MAX_REQUEST_BYTES // 8 - 4096
# One inline Lookup's rows (remote clients, debugging): larger lookups are split.
MAX_INLINE_BYTES = 64 << 20
