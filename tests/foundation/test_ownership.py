from pdd.router.ownership import OwnershipTracker


def test_p_md_in_order_with_duplicates_dropped():
    t = OwnershipTracker("P-MD")
    assert t.accept("main-decode", 2, [12]).token_ids == []  # early: buffered until 0 and 1 arrive
    assert t.accept("prefill", 0, [10]).token_ids == [10]
    e = t.accept("main-decode", 1, [11], None)
    assert e.token_ids == [11, 12]
    e = t.accept("main-decode", 2, [12, 13], "length")
    assert e.token_ids == [13] and e.finish_reason == "length"
    assert t.dropped == 1


def test_relay_then_md_switch_at_named_boundary():
    t = OwnershipTracker("P-RLD-MD")
    t.accept("prefill", 0, [1])
    assert t.accept("relay", 1, [2, 3]).token_ids == [2, 3]
    # MD starts emitting before the relay's boundary message arrives: held back
    assert t.accept("main-decode", 4, [5]).token_ids == []
    e = t.accept("relay", 3, [4])
    assert e.token_ids == [4]
    e = t.accept("relay", 4, [], owner_until=3)
    assert e.token_ids == [5]
    # a late relay token beyond its boundary is not emitted
    assert t.accept("relay", 4, [99]).token_ids == []
    e = t.accept("main-decode", 5, [6], "stop")
    assert e.token_ids == [6] and e.finish_reason == "stop"
    assert t.relay_tokens == 3


def test_relay_local_finish_and_prefill_finish():
    t = OwnershipTracker("P-RLD")
    t.accept("prefill", 0, [1])
    e = t.accept("relay", 1, [2, 3], "length")
    assert e.token_ids == [2, 3] and e.finish_reason == "length"
    assert t.accept("main-decode", 3, [4]).token_ids == []
    p = OwnershipTracker("P-MD")
    e = p.accept("prefill", 0, [7], "stop")
    assert e.token_ids == [7] and e.finish_reason == "stop"


def test_resumed_request_takes_positions_from_the_resume_point_only():
    t = OwnershipTracker("resume", next_position=5)
    assert t.accept("main-decode", 3, [1, 2, 3, 4]).token_ids == [3, 4]  # positions 3, 4 were already emitted
    assert t.accept("relay", 7, [9], "length").token_ids == [9]
    assert t.accept("prefill", 0, [1]).token_ids == []
    assert t.finish_reason == "length" and t.next_position == 8
