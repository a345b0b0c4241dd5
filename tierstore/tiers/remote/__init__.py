"""The remote tier on Mooncake Store: connect and run a loopback cluster
(mooncake), publish a version (publish), read its rows (reader.RemoteReader)
and make them local in the background (local_copy, writeback).
"""
