import pytest


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many arbitrary requests of each public type were sent, and what they got."""
    from tests.services.public_requests import TALLY

    if not TALLY:
        return
    terminalreporter.section("arbitrary public requests")
    for method, codes in sorted(TALLY.items()):
        seen = ", ".join(f"{code} {n}" for code, n in codes.most_common())
        terminalreporter.write_line(
            f"{method}: {sum(codes.values())} requests, {codes['INTERNAL']} INTERNAL ({seen})"
        )
