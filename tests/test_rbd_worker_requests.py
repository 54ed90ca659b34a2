"""Which ``rbd`` tool calls the rbd backend's worker serves (``rbd_worker.request_for``)."""

from __future__ import annotations

import pytest

from vbs.storage.backends.rbd_worker import request_for

pytestmark = pytest.mark.unit


def test_only_the_calls_it_serves_of_its_own_pool_go_to_the_worker() -> None:
    assert request_for(("snap", "create", "p/vol-1@snap-2"), "p") == {"op": "snap_create", "image": "vol-1",
                                                                       "snap": "snap-2"}
    assert request_for(("snap", "rm", "p/vol-1@snap-2"), "p") == {"op": "snap_remove", "image": "vol-1",
                                                                   "snap": "snap-2"}
    assert request_for(("snap", "ls", "--all", "--format", "json", "p/vol-1"), "p") == {"op": "snap_list",
                                                                                         "image": "vol-1"}
    assert request_for(("snap", "ls", "--all", "--format", "json", "--pool", "p", "--image-id", "ab12"), "p") == \
        {"op": "snap_list", "image_id": "ab12"}
    assert request_for(("ls", "-l", "--format", "json", "p"), "p") == {"op": "list_long"}
    assert request_for(("trash", "ls", "--all", "--format", "json", "p"), "p") == {"op": "trash_list"}
    for args in (("snap", "create", "other/vol-1@snap-2"), ("snap", "create", "p/vol-1"),
                 ("snap", "ls", "--all", "--format", "json", "p/vol-1@snap-2"), ("ls", "-l", "--format", "json", "q"),
                 ("clone", "p/vol-1@snap-2", "p/vol-3"),
                 ("snap", "rm", "--pool", "p", "--image-id", "ab", "--snap", "s"),
                 ("info", "--format", "json", "p/vol-1")):
        assert request_for(args, "p") is None, args
