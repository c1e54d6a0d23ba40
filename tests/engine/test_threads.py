"""The engine steps on fewer threads while a core is taken, and on all once it is free."""

from engine.threads import ThreadChoice

QUIET = {2: 0.010, 1: 0.016}  # seconds per sequence of a decode step, by threads
BUSY = {2: 0.080, 1: 0.018}


def run(choice: ThreadChoice, costs: dict[int, float], steps: int) -> list[int]:
    """The threads each of `steps` decode steps ran on, each taking `costs[threads]`."""
    used = []
    for _ in range(steps):
        threads = choice.threads()
        used.append(threads)
        choice.record(costs[threads] * 4, num_seqs=4, decode_only=True)
    return used


def test_a_quiet_machine_keeps_every_thread_trying_fewer_less_and_less_often() -> None:
    choice = ThreadChoice(2, retry_every=64, max_retry_every=512)
    used = run(choice, QUIET, 4000)
    # The first trial, at once, alternating with every thread step by step.
    assert used[:8] == [2] * 8 and used[8:24] == [1, 2] * 8
    assert used[24:88] == [2] * 64
    assert used.count(1) <= 8 * (1 + 1 + 1 + 1 + 4000 // 512)  # then 64, 128, 256, 512 apart


def test_a_core_taken_before_any_step_is_found_by_the_next_trial() -> None:
    choice = ThreadChoice(2, retry_every=64)
    used = run(choice, BUSY, 300)
    assert used[8:24] == [1, 2] * 8  # the first trial
    assert used[-200:].count(1) >= 200 - 16  # two retries of every thread, at most


def test_a_taken_core_moves_the_steps_to_fewer_threads_and_back_once_it_is_free() -> None:
    choice = ThreadChoice(2, retry_every=64)
    run(choice, QUIET, 50)
    busy = run(choice, BUSY, 200)
    assert busy[-100:].count(1) > 90  # after a few slow steps and a trial
    assert busy.index(1) < 20
    freed = run(choice, QUIET, 300)
    # The next retry finds the core free; later trials of fewer threads lose.
    assert freed[-50:].count(2) >= 50 - choice.window


def test_steps_slower_for_another_reason_keep_every_thread() -> None:
    choice = ThreadChoice(2, retry_every=1000)
    run(choice, QUIET, 50)
    longer = {2: 0.030, 1: 0.050}  # e.g. longer contexts: one thread is slower still
    used = run(choice, longer, 500)
    assert used.count(1) == choice.window  # one trial, then the new cost is the usual one
    assert used[-400:] == [2] * 400


def test_retries_that_lose_come_less_often() -> None:
    choice = ThreadChoice(2, retry_every=32, max_retry_every=128)
    run(choice, QUIET, 20)
    used = run(choice, BUSY, 2000)
    trials = [i for i in range(2, len(used)) if used[i] == 2 and used[i - 2 : i] == [1, 1]]
    gaps = [b - a for a, b in zip(trials, trials[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] > 128


def test_only_decode_steps_count() -> None:
    choice = ThreadChoice(2, retry_every=1000)
    run(choice, QUIET, 40)
    for _ in range(100):
        choice.record(5.0, num_seqs=4, decode_only=False)  # a long prefill
    assert choice.threads() == 2


def test_batches_that_shrink_and_grow_do_not_pass_for_a_faster_thread_count() -> None:
    """Steps of more sequences cost less per sequence: timed one after the other, a trial
    that starts with a new wave of requests would win whatever its threads."""
    choice = ThreadChoice(2, retry_every=16, max_retry_every=64)
    used = []
    for step in range(2000):
        num_seqs = 64 - (step % 80) * 63 // 79  # waves: 64 sequences, ending one by one
        threads = choice.threads()
        used.append(threads)
        per_seq = QUIET[threads] * (0.05 + 4 / num_seqs)  # batching amortizes the weights
        choice.record(per_seq * num_seqs, num_seqs=num_seqs, decode_only=True)
    # Only the trials, at most one every 64 steps by then, step on one thread.
    assert used[-1000:].count(1) <= (1000 // 64 + 1) * choice.window


def test_steps_that_prefill_run_on_the_chosen_threads_even_during_a_trial() -> None:
    choice = ThreadChoice(2, retry_every=1000)
    used = run(choice, QUIET, 10)  # the first trial has begun: one thread, then two
    assert used[-2:] == [1, 2]
    prefills = []
    for _ in range(20):  # a wave of new requests' prompts
        prefills.append(choice.threads())
        choice.record(0.3, num_seqs=8, decode_only=False)
    assert prefills == [1] + [2] * 19  # the step after the last decode one, then every thread
    assert run(choice, QUIET, 4).count(1) == 2  # the trial goes on with decode steps


def test_the_end_of_a_wave_is_no_slowdown() -> None:
    """A shrinking batch costs more per sequence, on every thread count alike: no trial."""
    choice = ThreadChoice(2, retry_every=10_000)
    used = []
    for step in range(800):
        num_seqs = 64 - (step % 80) * 63 // 79
        threads = choice.threads()
        used.append(threads)
        per_seq = QUIET[threads] * (0.05 + 4 / num_seqs)
        choice.record(per_seq * num_seqs, num_seqs=num_seqs, decode_only=True)
    assert used.count(1) == choice.window  # the first trial only
