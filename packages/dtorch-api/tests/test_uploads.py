"""The uploads a client keeps for a rebuild to ask for again (`_uploads.Uploads`): what it lets go of, and when."""

from __future__ import annotations

import torch

from dtorch._uploads import Uploads


def test_a_sync_lets_go_of_what_it_covers_but_what_the_controller_says_to_keep():
    """Rules 1 and 2: a done Sync covers the uploads kept before it began, except those asked for again that no
    snapshot holds yet (`SyncReply.keep`); `.safe` lets go of an upload at any time."""
    uploads = Uploads()
    for tid in (1, 2, 3):
        uploads.keep(tid, torch.ones(2), None)
    covered = uploads.kept()
    uploads.keep(4, torch.ones(2), None)  # after the Sync began
    uploads.safe(covered, keep=[2])
    assert sorted(uploads.kept()) == [2, 4]
    uploads.safe([2])
    assert uploads.kept() == [4]


def test_nothing_is_kept_where_the_controller_rebuilds_no_session():
    """Rule 1: `SessionOpened.recovery` False: no rebuild will ask for an upload again."""
    uploads = Uploads(keeping=False)
    uploads.keep(1, torch.ones(2), None)
    assert uploads.kept() == []
