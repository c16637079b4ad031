"""The routing rules, driven directly: no network, no clock."""

from __future__ import annotations

from router.outliers import Outliers
from router.routing import (
    TABLE_PER_REPLICA,
    AffinityTable,
    Balancer,
    prefix_hashes,
    prompt_text,
    session_hash,
    within_bound,
)

SYSTEM = "You are a careful assistant for the payroll team. " * 8  # ~400 characters


def chat(*turns: tuple[str, str]) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": r, "content": c} for r, c in turns]}


def test_prompts_sharing_a_prefix_share_hashes_exactly_as_far_as_the_prefix_goes() -> None:
    a = prefix_hashes(SYSTEM + "first question about taxes, " * 4)
    b = prefix_hashes(SYSTEM + "second question about leave " * 4)
    shared = len(SYSTEM) // 64
    assert a[:shared] == b[:shared]
    assert a[shared + 1 :] and not set(a[shared + 1 :]) & set(b[shared + 1 :])


def test_a_prompt_shorter_than_one_block_has_no_prefix_key() -> None:
    assert prefix_hashes("hello") == []
    assert len(prefix_hashes("x" * 64)) == 1
    assert len(prefix_hashes("x" * 100_000)) == 256


def test_a_conversation_turn_extends_the_previous_turns_prefix() -> None:
    turn1 = prefix_hashes(prompt_text(chat(("system", SYSTEM), ("user", "What is my leave balance?"))))
    turn2 = prefix_hashes(
        prompt_text(
            chat(
                ("system", SYSTEM),
                ("user", "What is my leave balance?"),
                ("assistant", "You have 12 days left this year."),
                ("user", "And next year?"),
            )
        )
    )
    assert turn2[: len(turn1)] == turn1


def test_prompt_text_reads_chat_messages_and_completion_prompts() -> None:
    assert "hello" in prompt_text({"messages": [{"role": "user", "content": "hello"}]})
    assert prompt_text({"prompt": "once upon a time"}) == "once upon a time"
    assert prompt_text({"prompt": ["first", "second"]}) == "first"
    assert prompt_text({"input": "embedding text"}) == ""
    # Parts-style content still gives a stable key.
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prompt_text(parts) == prompt_text(parts) != ""


def test_new_conversations_on_an_idle_fleet_are_spread_over_the_replicas() -> None:
    balancer = Balancer()
    replicas = ["a", "b", "c"]
    chosen = [
        balancer.choose("m", replicas, prefix=prefix_hashes(f"conversation {i} " * 20)) for i in range(30)
    ]
    assert {r: chosen.count(r) for r in replicas} == {"a": 10, "b": 10, "c": 10}


def test_a_conversation_stays_on_the_replica_that_holds_its_prefix() -> None:
    balancer = Balancer()
    replicas = ["a", "b", "c"]
    first = prefix_hashes(SYSTEM + "turn one")
    home = balancer.choose("m", replicas, prefix=first)
    for turn in range(10):
        # Other conversations come and go in between.
        balancer.choose("m", replicas, prefix=prefix_hashes(f"someone else {turn} " * 10))
        later = prefix_hashes(SYSTEM + "turn one" + " and more" * (turn + 1) * 10)
        assert balancer.choose("m", replicas, prefix=later) == home


def test_affinity_yields_to_load_once_the_holder_is_too_busy() -> None:
    balancer = Balancer(slack=2, balance_factor=1.5)
    replicas = ["a", "b"]
    prefix = prefix_hashes(SYSTEM)
    home = balancer.choose("m", replicas, prefix=prefix)
    other = "b" if home == "a" else "a"
    picks = []
    # Requests with the same prefix that never finish: the holder takes a few, then load wins.
    for _ in range(8):
        pick = balancer.choose("m", replicas, prefix=prefix)
        assert pick is not None
        balancer.acquire(pick)
        picks.append(pick)
    assert picks[:3] == [home] * 3
    assert other in picks
    loads = [balancer.outstanding.get(r, 0) for r in replicas]
    assert max(loads) - min(loads) <= 3


def test_a_session_pins_a_conversation_even_when_its_prompt_changes() -> None:
    balancer = Balancer()
    replicas = ["a", "b", "c", "d"]
    session = session_hash("user-42")
    home = balancer.choose("m", replicas, session=session, prefix=prefix_hashes("x" * 200))
    for i in range(6):
        balancer.choose("m", replicas, prefix=prefix_hashes(f"noise {i} " * 30))
        assert balancer.choose("m", replicas, session=session, prefix=prefix_hashes(f"new {i} " * 30)) == home


def test_a_session_does_not_pin_onto_an_overloaded_replica() -> None:
    balancer = Balancer(slack=1, balance_factor=1.2)
    session = session_hash("heavy-user")
    home = balancer.choose("m", ["a", "b"], session=session)
    assert home is not None
    for _ in range(5):
        balancer.acquire(home)
    assert balancer.choose("m", ["a", "b"], session=session) != home


def test_least_outstanding_wins_without_affinity() -> None:
    balancer = Balancer()
    for _ in range(3):
        balancer.acquire("a")
    balancer.acquire("b")
    assert balancer.choose("m", ["a", "b", "c"]) == "c"
    balancer.acquire("c")
    balancer.acquire("c")
    assert balancer.choose("m", ["a", "b", "c"]) == "b"
    balancer.release("a")
    balancer.release("a")
    balancer.release("a")
    assert balancer.outstanding.get("a") is None
    assert balancer.choose("m", ["a", "b", "c"]) == "a"


def test_a_replica_that_failed_is_skipped_until_its_ejection_ends() -> None:
    balancer = Balancer(outliers=Outliers(connect_s=5.0))
    balancer.outliers.connection_failed("a", now=5.0)
    picks = {balancer.choose("m", ["a", "b"], now=9.0) for _ in range(10)}
    assert picks == {"b"}
    picks = {balancer.choose("m", ["a", "b"], now=11.0) for _ in range(10)}
    assert picks == {"a", "b"}


def test_an_ejected_replica_is_still_used_when_it_is_the_only_one_left() -> None:
    balancer = Balancer(outliers=Outliers(connect_s=5.0))
    balancer.outliers.connection_failed("a", now=5.0)
    assert balancer.choose("m", ["a"], now=6.0) == "a"


def test_replicas_already_tried_are_excluded_and_none_is_returned_when_all_were() -> None:
    balancer = Balancer()
    assert balancer.choose("m", ["a", "b"], exclude=["a"]) == "b"
    assert balancer.choose("m", ["a", "b"], exclude=["a", "b"]) is None
    assert balancer.choose("m", []) is None


def test_affinity_ignores_a_holder_that_is_not_a_candidate_any_more() -> None:
    balancer = Balancer()
    prefix = prefix_hashes(SYSTEM)
    home = balancer.choose("m", ["a", "b"], prefix=prefix)
    remaining = ["b"] if home == "a" else ["a"]
    assert balancer.choose("m", remaining, prefix=prefix) == remaining[0]
    # ...and the prefix now lives with the replica that took it, most recent first.
    assert balancer.table("m").lookup(prefix, {"a", "b"}) == ([remaining[0], home], len(prefix))


def test_tables_are_per_model() -> None:
    balancer = Balancer()
    prefix = prefix_hashes(SYSTEM)
    balancer.choose("m1", ["a"], prefix=prefix)
    assert balancer.table("m2").lookup(prefix, {"a"}) == ([], 0)
    assert balancer.table("m1").lookup(prefix, {"a"}) == (["a"], len(prefix))


def test_the_affinity_table_forgets_the_least_recently_used_keys_first() -> None:
    table = AffinityTable(capacity=4)
    table.record([1, 2, 3], "a")
    table.record([1], "a")
    table.record([4, 5], "b")
    assert len(table) == 4
    assert table.get(2) is None and table.get(1) == "a" and table.get(5) == "b"
    table.resize(2)
    assert len(table) == 2 and table.get(1) is None and table.get(4) == "b"


def test_a_key_remembers_its_most_recent_holders() -> None:
    table = AffinityTable(holders=2)
    table.record([7], "a")
    table.record([7], "b")
    table.record([7], "c")
    assert table.lookup([7], {"a", "b", "c"}) == (["c", "b"], 1)
    table.record([7], "b")
    assert table.lookup([7], {"a", "b", "c"}) == (["b", "c"], 1)
    # A holder that is gone is passed over, not searched for and removed.
    assert table.lookup([7], {"a", "c"}) == (["c"], 1)


def test_a_models_table_shrinks_with_its_replicas_and_goes_with_the_last() -> None:
    balancer = Balancer(table_capacity=100_000)
    balancer.choose("m", ["a", "b"], prefix=list(range(40_000)))
    assert len(balancer.table("m")) == 40_000
    balancer.fleet_size("m", 1)
    assert len(balancer.table("m")) == TABLE_PER_REPLICA
    balancer.fleet_size("m", 0)
    assert len(balancer.table("m")) == 0


def test_five_5xx_in_a_row_eject_a_replica_for_a_back_off_that_grows_and_a_success_resets_it() -> None:
    ejections: list[tuple[object, str, float]] = []
    outliers = Outliers(base_s=30.0, max_s=300.0, on_eject=lambda r, why, s: ejections.append((r, why, s)))
    for _ in range(4):
        outliers.failed("a", now=0.0)
    outliers.succeeded("a")
    for _ in range(4):
        outliers.failed("a", now=0.0)
    assert ejections == []
    outliers.failed("a", now=0.0)
    assert ejections == [("a", "consecutive_5xx", 30.0)] and outliers.ejected(1.0) == {"a"}
    for _ in range(5):
        outliers.failed("a", now=31.0)
    assert ejections[-1] == ("a", "consecutive_5xx", 60.0)
    outliers.succeeded("a")
    for _ in range(5):
        outliers.failed("a", now=100.0)
    assert ejections[-1] == ("a", "consecutive_5xx", 30.0)


def test_a_system_prompt_held_by_several_replicas_spreads_new_conversations_among_them() -> None:
    balancer = Balancer()
    replicas = ["a", "b", "c"]
    table = balancer.table("m")
    system = prefix_hashes(SYSTEM)
    for replica in replicas:
        table.record(system, replica)
    homes = [
        balancer.choose("m", replicas, prefix=prefix_hashes(SYSTEM + f"user {i} " * 12)) for i in range(9)
    ]
    assert sorted(homes.count(r) for r in replicas) == [3, 3, 3]


def test_a_shared_system_prompt_on_one_replica_draws_new_conversations_to_it_while_it_is_idle() -> None:
    # The documented trade: its prefix is cached there, and nothing is waiting there yet.
    balancer = Balancer()
    replicas = ["a", "b", "c"]
    home = balancer.choose("m", replicas, prefix=prefix_hashes(SYSTEM))
    homes = {
        balancer.choose("m", replicas, prefix=prefix_hashes(SYSTEM + f"user {i} " * 12)) for i in range(5)
    }
    assert homes == {home}


def test_within_bound_allows_slack_then_a_multiple_of_the_average() -> None:
    assert within_bound(2, [2, 0], slack=2, balance_factor=1.5)
    assert not within_bound(3, [3, 0], slack=2, balance_factor=1.5)
    # Under heavy load the bound is relative: 40 against 30 is within 1.5x the average.
    assert within_bound(40, [40, 30], slack=2, balance_factor=1.5)
    assert not within_bound(60, [60, 20], slack=2, balance_factor=1.2)


def test_the_comparison_policies_ignore_where_a_prefix_went() -> None:
    """least-outstanding and round-robin are what affinity is measured against; neither may
    follow a conversation's prefix, or the comparison measures nothing."""
    prefix = prefix_hashes(SYSTEM)
    replicas = ["a", "b", "c"]
    for policy in ("least-outstanding", "round-robin"):
        balancer = Balancer(policy=policy)
        picks = [balancer.choose("m", replicas, prefix=prefix) for _ in range(9)]
        assert {r: picks.count(r) for r in replicas} == {"a": 3, "b": 3, "c": 3}, policy
    # With load, least-outstanding goes to the idle replica and round-robin does not look.
    balancer = Balancer(policy="least-outstanding")
    balancer.acquire("a")
    balancer.acquire("b")
    assert balancer.choose("m", replicas, prefix=prefix) == "c"
    rr = Balancer(policy="round-robin")
    for replica in ("a", "b"):
        for _ in range(5):
            rr.acquire(replica)
    assert [rr.choose("m", replicas) for _ in range(3)] == ["b", "c", "a"]


def test_a_new_conversation_sharing_less_than_half_its_prompt_goes_by_load() -> None:
    """A hot system prompt must not pile its conversations onto the replicas that saw it first:
    when the cached part is under half the prompt, load decides; the turns after stay home."""
    balancer = Balancer()
    replicas = ["a", "b", "c"]
    system = "be brief. " * 20
    homes = []
    for i in range(6):
        # Each conversation: the shared system prompt, then a document of its own three times
        # as long.
        opening = prefix_hashes(system + f"document {i} " * 60)
        home = balancer.choose("m", replicas, prefix=opening)
        assert home is not None
        homes.append(home)
        later = prefix_hashes(system + f"document {i} " * 60 + "and a question")
        assert balancer.choose("m", replicas, prefix=later) == home
    assert sorted(homes) == ["a", "a", "b", "b", "c", "c"]
