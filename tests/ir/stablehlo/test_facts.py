"""The pass's per-op facts (``_ir.stablehlo.facts``): computed once per op while a pass runs,
never shared between threads, forgotten when asked (a trial inlining undone)."""
import threading

from hlofold._ir.stablehlo import facts


def test_a_fact_is_computed_once_per_op_and_kind_while_active():
    calls = []

    def compute(op):
        calls.append(op)
        return len(calls)

    assert facts.op_fact("k", "a", compute) == 1          # inactive: computed every time
    assert facts.op_fact("k", "a", compute) == 2
    with facts.op_facts():
        assert facts.op_fact("k", "a", compute) == 3
        assert facts.op_fact("k", "a", compute) == 3      # kept
        assert facts.op_fact("other", "a", compute) == 4   # another kind of fact
        with facts.op_facts():                             # nested: the same memo
            assert facts.op_fact("k", "a", compute) == 3
        assert facts.op_fact("k", "a", compute) == 3
        facts.forget_op_facts()
        assert facts.op_fact("k", "a", compute) == 5
    assert facts.op_fact("k", "a", compute) == 6          # gone with the pass


def test_threads_keep_their_own_facts():
    seen = {}
    barrier = threading.Barrier(2)

    def run(name):
        with facts.op_facts():
            facts.op_fact("k", "op", lambda op: name)
            barrier.wait()                  # both memos filled before either reads
            seen[name] = facts.op_fact("k", "op", lambda op: "other")
    threads = [threading.Thread(target=run, args=(n,)) for n in ("t1", "t2")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == {"t1": "t1", "t2": "t2"}
