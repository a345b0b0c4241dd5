"""A closed Client says so in a tierstore error, not grpc's bare ValueError."""
import pytest

from tierstore import errors
from tierstore.client.client import Client


def test_a_closed_client_says_it_is_closed(tmp_path):
    c = Client(tmp_path / "s.sock")
    c.close()
    with pytest.raises(errors.InvalidArgument, match="is closed; make a new Client"):
        c.tables()
