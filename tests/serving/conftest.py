import pytest

from tests.runtime.helpers import free_port


@pytest.fixture(scope="session")
def serve_port():
    """Ray Serve's HTTP proxy keeps the port it first started on: one for the whole suite."""
    return free_port()
