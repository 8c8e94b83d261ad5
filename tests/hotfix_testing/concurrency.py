"""Running checks on several threads at once, interleaved inside their calls, for cross-talk tests."""

import sys
import threading


def _interleaved(work, arguments, switch_interval: float) -> None:
    """``work(argument)`` on one thread per argument, all started, with a tiny switch interval so the threads
    interleave inside their calls, then joined."""
    threads = [threading.Thread(target=work, args=(argument,)) for argument in arguments]
    previous = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(previous)


def failures_running_concurrently(checks, rounds: int) -> list[str]:
    """Run each ``check`` (returns True when its result is right) ``rounds`` times on its own thread, all threads
    started together with a tiny switch interval so they interleave inside forwards, not only between them.
    Returns what went wrong: wrong results and exceptions."""
    start = threading.Barrier(len(checks))
    failures: list[str] = []

    def loop(check):
        start.wait()
        for _ in range(rounds):
            try:
                if not check():
                    failures.append("wrong result")
            except Exception as exc:  # noqa: BLE001 - any error is cross-talk here
                failures.append(f"{type(exc).__name__}: {exc}")

    _interleaved(loop, checks, 1e-5)
    return failures


def start_together(calls) -> list[str]:
    """Run each of ``calls`` once on its own thread, all released by one barrier with a tiny switch interval, and
    wait for them: one round of a race. Returns the errors they raised."""
    start = threading.Barrier(len(calls))
    errors: list[str] = []

    def run(call):
        start.wait()
        try:
            call()
        except Exception as exc:  # noqa: BLE001 - any error is a lost race here
            errors.append(f"{type(exc).__name__}: {exc}")

    _interleaved(run, calls, 1e-6)
    return errors
