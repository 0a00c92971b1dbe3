"""Threads that follow the machine's load (minicb/cpu_threads.py), on a machine the test plays.

SharedCores reads two clocks of busy time, the machine's and this process's, and
a wall clock; here all three are counters the test moves, so a "busy machine"
is a number, and each test can say exactly what the engine should do. The
engine test changes the thread count between every two steps of a real engine
and holds its tokens to an engine whose threads never change.
"""
from __future__ import annotations

import pytest
import torch

from minicb.config import EngineConfig
from minicb.cpu_threads import (FixedThreads, SharedCores, busy_cpu_seconds, starting_threads, thread_policy,
                                threads_for)
from minicb.engine import Engine
from minicb.model import random_model
from minicb.sampling import SamplingParams


@pytest.mark.parametrize("cores, others, most, want", [
    (2, 0.0, 2, 2),    # alone: every core
    (2, 0.3, 2, 2),    # a browser ticking over: still both
    (2, 1.0, 2, 1),    # two busy loops squeezed to one core between them: one thread, nothing spins
    (2, 1.9, 2, 1),    # never fewer than one
    (8, 2.2, 8, 6),    # the cores the others leave
    (8, 0.0, 4, 4),    # never more than the engine started with (--threads 4)
])
def test_threads_for_takes_the_cores_the_others_leave(cores, others, most, want):
    assert threads_for(cores, others, most) == want, f"{cores} cores, others busy on {others}: {want} threads"


class Machine:
    """A machine's busy seconds, this process's and a wall clock, moved by the test."""

    def __init__(self):
        self.now = self.machine = self.own = 0.0
        self.set_to: list[int] = []

    def run(self, seconds: float, ours: float, others: float) -> None:
        """`seconds` pass with this process busy on `ours` cores and other programs on `others`."""
        self.now += seconds
        self.own += ours * seconds
        self.machine += (ours + others) * seconds

    def shared(self, most: int = 2, interval_s: float = 1.0) -> SharedCores:
        return SharedCores(most, frozenset({0, 1}), interval_s, machine_busy=lambda: self.machine,
                           own_busy=lambda: self.own, clock=lambda: self.now, set_threads=self.set_to.append)


def test_shared_cores_follow_other_programs_and_come_back():
    machine = Machine()
    shared = machine.shared()
    machine.run(1.5, ours=2.0, others=0.0)  # alone, spinning on both cores: nothing to change
    shared.adjust()
    assert machine.set_to == [] and shared.threads == 2
    machine.run(1.0, ours=1.0, others=1.0)  # two busy loops arrive and take half the machine
    shared.adjust()
    assert machine.set_to == [1], f"others busy on a whole core must leave one thread; set {machine.set_to}"
    machine.run(1.0, ours=0.7, others=1.3)
    shared.adjust()
    assert machine.set_to == [1], "no change while the others stay"
    machine.run(1.0, ours=1.0, others=0.05)  # they stop
    shared.adjust()
    assert machine.set_to == [1, 2] and shared.threads == 2, f"the cores must come back; set {machine.set_to}"
    assert [threads for _, _, threads in shared.changes] == [1, 2]


def test_shared_cores_measure_once_an_interval():
    machine = Machine()
    shared = machine.shared(interval_s=1.0)
    for _ in range(3):  # steps of 0.25 s, while other programs are busy: not yet a whole interval
        machine.run(0.25, ours=1.0, others=1.0)
        shared.adjust()
    assert machine.set_to == [], "adjust() measured before an interval had passed"
    machine.run(0.25, ours=1.0, others=1.0)
    shared.adjust()
    assert machine.set_to == [1]


def test_busy_seconds_count_work_on_our_cpus_only(tmp_path, monkeypatch):
    # user nice system idle iowait irq softirq steal: all but idle and iowait are work
    stat = tmp_path / "stat"
    stat.write_text("cpu  999 999 999 999 999 999 999 999 0 0\n"
                    "cpu0 10 1 2 500 40 3 4 5 0 0\n"
                    "cpu1 100 100 100 100 100 100 100 100 0 0\n"
                    "cpu2 20 0 0 700 0 0 0 0 0 0\n"
                    "intr 12345\n")
    monkeypatch.setattr("os.sysconf", lambda name: 100)  # 100 ticks a second
    assert busy_cpu_seconds(frozenset({0, 2}), str(stat)) == pytest.approx((10 + 1 + 2 + 3 + 4 + 5 + 20) / 100)


def test_the_setting_picks_the_policy():
    assert isinstance(thread_policy("fixed", "cpu"), FixedThreads)
    assert isinstance(thread_policy("share", "meta"), FixedThreads), "only a CPU's threads are shared"
    shared = thread_policy("share", "cpu")
    assert isinstance(shared, SharedCores) and shared.most == starting_threads()


def test_the_most_is_what_threads_chose(monkeypatch):
    import minicb.cpu_attention as cpu_attention

    monkeypatch.setattr(cpu_attention, "_chosen_threads", 3)  # as after --threads 3
    assert thread_policy("share", "cpu").most == 3
    monkeypatch.setattr(cpu_attention, "_chosen_threads", None)  # never chosen: torch's count at the first engine
    first, before = thread_policy("share", "cpu").most, torch.get_num_threads()
    cpu_attention.apply_num_threads(1)  # as an engine on a busy machine leaves it
    try:
        assert thread_policy("share", "cpu").most == first, "a later engine lost the cores an earlier one let go"
    finally:
        cpu_attention.apply_num_threads(before)


def test_an_engine_after_a_busy_one_gets_its_cores_back():
    machine = Machine()
    shared = SharedCores(2, frozenset({0, 1}), 1.0, machine_busy=lambda: machine.machine, own_busy=lambda: machine.own,
                         clock=lambda: machine.now, set_threads=machine.set_to.append, threads=1)
    machine.run(1.0, ours=1.0, others=0.0)  # left at one thread by an engine before, on a machine now idle
    shared.adjust()
    assert machine.set_to == [2] and shared.threads == 2
    with pytest.raises(ValueError, match="cpu_threads='some'"):
        EngineConfig(cpu_threads="some")


def test_changing_threads_between_steps_changes_no_token():
    """A real engine whose thread count flips between 1 and 2 every step gives the fixed engine's tokens."""
    from minicb.cpu_attention import apply_num_threads

    model = random_model(seed=3)  # the tiny random model
    prompts = [[1 + (7 * i + j) % 200 for j in range(5 + 3 * i)] for i in range(6)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    before = torch.get_num_threads()

    def tokens(engine: Engine) -> dict[int, list[int]]:
        ids = [engine.add_request(p, params) for p in prompts]
        out = {i: [] for i in ids}
        while engine.has_unfinished():
            for token in engine.step().new_tokens:
                out[token.request_id].append(token.token)
        return [out[i] for i in ids]

    fixed = tokens(Engine(model, EngineConfig(max_num_seqs=4, block_size=4, cpu_threads="fixed")))
    engine = Engine(model, EngineConfig(max_num_seqs=4, block_size=4))
    machine, flips = Machine(), iter(range(10**6))
    shared = SharedCores(2, frozenset({0, 1}), interval_s=0.0, clock=lambda: machine.now,
                         machine_busy=lambda: machine.machine, own_busy=lambda: machine.own,
                         set_threads=apply_num_threads)
    engine.runner.threads = shared

    def busy_every_other_step():
        machine.run(1.0, ours=1.0, others=1.0 if next(flips) % 2 else 0.0)
        SharedCores.adjust(shared)

    shared.adjust = busy_every_other_step
    try:
        assert tokens(engine) == fixed, "a thread count changed between steps changed the tokens"
    finally:
        apply_num_threads(before)
    assert len(shared.changes) >= 4, f"the test meant to change the threads often; it changed {shared.changes}"
