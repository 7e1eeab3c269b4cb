"""Held requests whose copies are done (:mod:`s3kv.tiering.worker.sending`):
reported as finished sending once, and only once vLLM has passed them as
finished. Through the worker side, with vLLM's CPU build:
test_connector_worker_keys.py."""

from s3kv.tiering.worker.sending import FinishedSending, RecentSet


def test_a_recent_set_keeps_its_most_recent_members():
    s = RecentSet(2)
    s.update(["a", "b"])
    s.update(["a", "c"])  # "a" is recent again: "b" goes
    assert "a" in s and "c" in s and "b" not in s
    s.discard("a")
    assert "a" not in s and "c" in s


def test_a_held_request_is_finished_sending_once_copied_and_passed_as_finished():
    sending = FinishedSending()
    sending.copied(["r1", "r2"])
    assert sending.take(None) == set()  # vLLM has passed neither as finished
    assert sending.take({"r1"}) == {"r1"}
    assert sending.take({"r1"}) == set()  # reported once
    assert sending.take(set()) == set()
    assert sending.take({"r3"}) == set()  # passed as finished before its copies are done
    sending.copied(["r3"])
    assert sending.take(set()) == {"r3"}
    assert sending.take({"r2"}) == {"r2"}


def test_only_the_most_recently_finished_requests_are_remembered():
    sending = FinishedSending(remembered=2)
    sending.take({"old"})
    sending.take({"a", "b"})  # "old" is forgotten
    sending.copied(["old", "a"])
    assert sending.take(None) == {"a"}
