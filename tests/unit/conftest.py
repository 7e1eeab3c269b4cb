"""Fixtures the unit tests share."""

import pytest

from s3kv.stores.memory import MemoryStore
from tests.stores.wrappers import DirectoryBucketStore


@pytest.fixture(params=["general", "directory"])
def bucket_kind(request):
    """The sharing tests run on a general-purpose bucket and on a directory
    bucket (S3 Express: listed in no order, no StartAfter, segments filed
    under minute prefixes); on the latter nothing may ask for StartAfter."""
    stores = []

    def make(inner=None):
        inner = MemoryStore() if inner is None else inner
        store = DirectoryBucketStore(inner) if request.param == "directory" else inner
        stores.append(store)
        return store

    yield make
    for store in stores:
        if store.directory:
            assert store.start_after_ignored == 0 and store.listed
