"""No sleep stands in for a condition in tests/: every `sleep(` says why a sleep is right there.

A sleep that waits for something to happen ("the joins are in by now") passes on a quiet machine
and flakes on a loaded one. Wait on the condition instead: a `trio.Event`, a poll of real state
with a deadline, or trio's `MockClock` (`autojump_clock`) where the state machine can be driven
that way.

The convention: a line of tests/*.py (and tests/**/*.py) that contains `sleep(` carries, on the
same line, a comment that starts with `# sleep:` followed by the reason a sleep is right there,
for example

    await trio.sleep(0.05)  # sleep: poll interval
    await trio.sleep(3)  # sleep: the delay is what is tested
    time.sleep(1.0)  # sleep: lets the SIGSTOPped process stall

A poll interval inside a loop with a deadline, a delay that is itself under test, time passed
deliberately (a stopped process stalls, a chaos harness waits, an absence is checked over a
while), and virtual time on trio's MockClock are reasons; "long enough for X to happen" is not:
wait for X. This test is a plain text scan; it imports nothing from the project.
"""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SLEEP = "sleep("
REASON = re.compile(r"#\s*sleep:\s*\S")


def offenders() -> list[str]:
    """file:line of each line under tests/ with `sleep(` and no `# sleep: <reason>` comment."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        if path.resolve() == Path(__file__).resolve():
            continue
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
        for number, line in enumerate(lines, 1):
            if SLEEP in line and not REASON.search(line):
                found.append(f"{path.relative_to(TESTS.parent)}:{number}: {line.strip()}")
    return found


def test_every_sleep_in_tests_says_why_it_is_not_a_wait_on_a_condition():
    found = offenders()
    assert not found, (
        f"{len(found)} line(s) in tests/ sleep without a `# sleep: <reason>` comment on the same line "
        "(wait on the condition instead, or say why a sleep is right; see this module's docstring):\n"
        + "\n".join(found)
    )


def test_the_convention_is_read_as_documented():
    assert REASON.search("await trio.sleep(0.05)  # sleep: poll interval")
    assert not REASON.search("await trio.sleep(1.0)  # the joins are in by now")
    assert not REASON.search("await trio.sleep(1.0)  # sleep:")
